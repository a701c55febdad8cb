"""A node's training engine (one process or DDP, AMP, checkpoints), local train/evaluate, DP-SGD."""
