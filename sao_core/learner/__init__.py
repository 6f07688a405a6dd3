"""The RL learner: SAO and the GRPO baselines on one loop, fed by rollout services."""
