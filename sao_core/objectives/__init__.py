"""Training objectives: pure functions of tensors (no I/O, no config objects)."""
