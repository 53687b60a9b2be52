"""Serving on Ray Serve: a FastAPI ingress (Open Inference Protocol v2 + simple JSON) in front of
ONNX Runtime model replicas with dynamic batching and autoscaling.

- protocol.py: parsing and validating requests, encoding answers (pure functions, no Ray)
- model_server.py: the per-model replica (artifact -> ONNX Runtime, @serve.batch)
- ingress.py: the HTTP API
- app.py: `build_app(args)`, the application builder `serve deploy` and the deploy job use
"""
