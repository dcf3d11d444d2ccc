"""Shipped checkpoints of the digits workload (see README.md here for how to regenerate them)."""
