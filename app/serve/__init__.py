"""Serving on Ray Serve: one application per model, whose replica parses the HTTP request and
runs its model (app/runtime) with dynamic batching and autoscaling, plus an index application
for the routes that span models. Three planes, each changing for its own reasons:

- http/: what a request is on the wire. api.py (the app and its routes), gate.py (the one
  middleware, request metrics, the body read within bounds as strict JSON), routes/ (v2 with
  its wire format, v1, generation, retrieval), requests.py (the strict generation request
  models), completions.py (OpenAI's response and SSE encoders), clients.py (how routes reach
  models: in-process or through a handle; 404, 503, 504).
- replicas/: what runs a model. model_server.py (a classifier), lm_server.py (a language model
  over the decode loop), batching.py, chat.py (chat templates), apps.py (the Serve deployment
  classes).
- control/: what changes the cluster. builders.py (applications from config), deploy.py,
  deploy_lock.py, lifecycle.py (list, undeploy, prune).
- metrics.py: the buffer (and flush thread) through which both planes record their metrics.
"""
