"""minimax: `declaration` (torch-free: capabilities and cache shapes from config.json); no forward pass yet."""
