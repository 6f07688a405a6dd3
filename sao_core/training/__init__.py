"""The shared training core: tokenisation, batching, schedules and the training loops."""
