"""lfm2_moe: `declaration` (torch-free: capabilities and cache shapes from config.json) and `model` (the torch module)."""
