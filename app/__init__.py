"""Distributed training and serving of PyTorch models on Ray.

One package per stage: data (raw data -> Parquet shards -> worker feeds), models (plain
torch.nn), tasks (what a run learns), train (Ray Train + Tune), export (ONNX artifacts) and
serve (Ray Serve, deploy, model lifecycle); evaluate, predict and pipeline are one module each;
config, errors, storage and cli are shared by all. Nothing here runs at import time.
"""

__version__ = "0.1.0"
