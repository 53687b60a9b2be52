"""The HTTP plane: what a request is on the wire (app/serve/__init__.py)."""
