"""The control plane: deploying, updating and retiring applications (app/serve/__init__.py)."""
