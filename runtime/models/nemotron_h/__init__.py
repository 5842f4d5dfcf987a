"""nemotron_h: `declaration` (torch-free: what it supports and caches) and `model` (the torch module)."""
