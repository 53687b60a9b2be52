"""Thin entry points, one per stage: `python -m jobs.<stage> --config ... [overrides]`."""
