"""v41jax: DeepSeek-V4.1's hierarchical sparse indexer and FP4 main KV cache, at toy scale."""
