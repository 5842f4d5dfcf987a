"""qwen3_5_moe: `declaration` (torch-free: capabilities and cache shapes from config.json); no forward pass yet."""
