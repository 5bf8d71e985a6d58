"""The detokenizer process: token ids from scheduler rank 0 in, incremental text to the api out."""
