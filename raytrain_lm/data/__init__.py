"""Data: corpora (sources) -> tokenizers (tokenizer) -> token shards and manifest (prepare,
tokenize) -> memory-mapped windows (windows) -> which windows each rank reads (sampler, loaders).
Shared storage: remote; per node: resolve."""
