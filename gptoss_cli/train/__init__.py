"""Training: the launcher, the loop, data, checkpoints and metrics."""
