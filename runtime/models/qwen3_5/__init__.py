"""qwen3_5: `declaration` (torch-free: what it supports and caches); no forward pass yet."""
