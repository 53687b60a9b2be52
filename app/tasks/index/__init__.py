"""The `index` task: what it adds at every stage (task.py composes it)."""
