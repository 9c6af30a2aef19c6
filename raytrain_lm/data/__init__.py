"""Data: corpora (sources) -> token shards and manifest (prepare) -> memory-mapped windows
(windows) -> which windows each rank reads (sampler). Shared storage: remote; per node: resolve."""
