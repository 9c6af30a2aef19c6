"""Which layout to train a model with: memory, communication and step time of every layout that
divides the GPUs, ranked (the model and its assumptions: docs/planner.md#assumptions)."""
