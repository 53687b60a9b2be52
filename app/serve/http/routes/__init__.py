"""The HTTP routes, one router per API: `v2` (Open Inference Protocol), `v1` (simple JSON and
the model list), `generation` (OpenAI completions and Triton's generate extension). Each route
decodes its request, asks `Models` (app/serve/http/clients.py) and encodes the answer; errors are
raised as `RequestError` and answered by app/serve/http/api.py.
"""
