"""The driver side of a run, never torch: the checks before a worker starts (preflight), building
the trainer and following the run (driver), worker groups, the CPUs a worker gets (cpus) and
TensorBoard files."""
