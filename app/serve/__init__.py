"""Serving on Ray Serve: one application per model, whose replica parses the HTTP request
(Open Inference Protocol v2 + simple JSON) and runs its own ONNX Runtime session with dynamic
batching and autoscaling, plus an index application for the routes that span models.

- protocol.py: parsing and validating requests, encoding answers (pure functions, no Ray)
- model_server.py: a model replica's state (artifact -> ONNX Runtime, batching off the event loop)
- ingress.py: the HTTP API (the same routes in every application)
- app.py: the application builders `serve deploy` and the deploy job use
- lm_server.py, completions.py: text generation (the replica over app/export/generate.py, the HTTP contract)
- deploy.py, deploy_lock.py, lifecycle.py: deploying, undeploying and pruning models
"""
