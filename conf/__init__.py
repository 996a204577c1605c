"""Typed configuration (schema.py, with model.moe in moe_schema.py; presets.py) and its Hydra registration (store.py,
imported only at the edge)."""
