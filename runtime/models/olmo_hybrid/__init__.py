"""olmo_hybrid: `declaration` (torch-free: what it supports and caches); no forward pass yet."""
