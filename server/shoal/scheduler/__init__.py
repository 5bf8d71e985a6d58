"""The scheduler process: continuous batching over the paged KV pool, one process per rank."""
