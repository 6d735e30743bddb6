"""Training: wrapping models for data parallelism, the optimizer, the step, checkpoints, the loop."""
