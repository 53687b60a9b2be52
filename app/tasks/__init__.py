"""The tasks, a folder each: what a task adds at every stage (its kind-of-data hooks, loss and
steps, evaluation, export graphs, predict rows, replica and smoke request), over the shared
machinery of the stage packages, which knows no task. The top layer: a task folder may import
any stage; no stage imports a task (they ask the registry, app/registry.py)."""
