"""Serving on Ray Serve: one application per model, whose replica parses the HTTP request and
runs its model (app/runtime) with dynamic batching and autoscaling, plus an index application
for the routes that span models. Three planes, each changing for its own reasons:

- http/: what a request is on the wire. api.py (the app: the v1 and v2 routes and each task's
  own, app/tasks/<task>/http/), gate.py (the one middleware, request metrics, the body read
  within bounds as strict JSON), routes/ (v2 with its wire format, v1), protocol.py (strict
  request bodies, one-line refusals), clients.py (how routes reach models: in-process or
  through a handle; 404, 503, 504).
- replicas/: what runs a model. base.py (the one replica base: start-up, variant choice,
  reconfigure, info; each task's replica in app/tasks/<task>/replica.py), batching.py, apps.py
  (the Serve deployment classes).
- control/: what changes the cluster. builders.py (applications from config), deploy.py,
  deploy_lock.py, lifecycle.py (list, undeploy, prune).
- metrics.py: the buffer (and flush thread) through which both planes record their metrics.
"""
