"""Typed configuration (schema.py, presets.py) and its Hydra registration (store.py, imported only at the edge)."""
