"""The runtime: what runs an exported artifact, on every request and every batch. No torch, no
Ray: export verifies its artifacts through it, serving and batch inference run it.

- artifact.py: reading an artifact (resolve `latest`, hash every file first), its ONNX Runtime
  sessions (providers by what exists), the manifest contract
- types.py: the typed contract between routes, replicas, batch inference and tests
- rows.py: raw rows checked against an artifact's schema (the one row check of serving and
  batch inference)
- kv.py: a language model's step on a KV cache, and a batch of caches
- decoding.py: from a step's logits to a stream's text (the sampler, the detokenizer and stop
  strings, a stream's state between steps), and the exported model it runs on (`Generator`)
- decode_loop.py: the engine that steps every running stream together (continuous batching)
"""
