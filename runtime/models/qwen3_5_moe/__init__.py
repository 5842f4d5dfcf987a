"""qwen3_5_moe: `declaration` (torch-free: what it supports and caches); no forward pass yet."""
