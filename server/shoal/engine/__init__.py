"""The per-rank compute side: KV memory, forward batches, model runner, sampling."""
