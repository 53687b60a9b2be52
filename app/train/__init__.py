"""Training: the Ray Train driver and worker loop (trainer), the Ray-free epoch (loop), DDP/FSDP
wrapping (parallel), resumable checkpoints, per-step profiling, experiment tracking, and the
Ray Tune search over whole training runs (tuning).
"""
