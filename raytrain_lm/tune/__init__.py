"""Hyperparameters: Ray Tune sweeps with ASHA (sweep), their search spaces (space) and what they
show and leave behind (report); the LR range test (lr_find); --scale-lr (lr_scaling)."""
