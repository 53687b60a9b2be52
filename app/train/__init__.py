"""Training: the Ray Train driver (driver) and each rank's life (worker), the Ray-free epoch
(loop), DDP/FSDP/pipeline wrapping (parallel, pipelining, splits, vocab_parallel), resumable
checkpoints (checkpoint, consolidate), fine-tuning (finetune), per-step profiling, experiment
tracking, and the Ray Tune search over whole training runs (tuning).
"""
