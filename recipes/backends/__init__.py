"""One module per backend, each defining `BACKEND` and `RECIPES`; recipes/registry.py finds them here."""
