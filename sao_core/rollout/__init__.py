"""The rollout side: trajectory records, inference engines, episodes, and the HTTP rollout service."""
