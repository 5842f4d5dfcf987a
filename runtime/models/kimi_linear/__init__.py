"""kimi_linear: `declaration` (torch-free: capabilities and the KDA state shapes from config.json).

No forward pass yet.
"""
