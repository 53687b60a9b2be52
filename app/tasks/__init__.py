"""Tasks: what a run learns, chosen by its dataset (a registry of task objects), and each
task's own parts (loss, validation, evaluation, baselines).
Stages ask the task; they do not compare task names.
"""
