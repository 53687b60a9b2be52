"""The replica plane: what runs a model behind its routes (app/serve/__init__.py)."""
