"""Distributed training and serving of PyTorch models on Ray.

One module per stage: config, sources/prepare (raw data -> Parquet), preprocess (fitted transforms
shared by training and serving), data (Ray Data ingest), models (plain torch.nn), train, checkpoint,
evaluate, export, artifact, serve, deploy. Nothing here runs at import time.
"""

__version__ = "0.1.0"
