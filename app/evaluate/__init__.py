"""The evaluate stage: a checkpoint scored on held-out rows (held_out.py), by its task's part."""
