"""`serve:`: the Serve application: replicas, autoscaling, batching, generation, limits (app/serve/)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from app.config.section import Section


class AutoscalingConfig(Section):
    min_replicas: int = Field(1, ge=0)  # replicas per model at least
    max_replicas: int = Field(2, ge=1)  # replicas per model at most
    target_ongoing_requests: float = Field(
        2.0, gt=0
    )  # Serve scales toward this many requests in flight per replica
    upscale_delay_s: float = Field(
        5.0, ge=0
    )  # how long load must stay high before a replica is added
    downscale_delay_s: float = Field(
        30.0, ge=0
    )  # how long load must stay low before one is removed
    metrics_interval_s: float = Field(1.0, gt=0)  # how often replicas report their load
    look_back_period_s: float = Field(5.0, gt=0)  # the window the load is averaged over


class BatchingConfig(Section):
    """`serve.batching`: how a classifier replica batches requests (app/serve/replicas/batching.py)."""

    max_batch_size: int = Field(16, ge=1)
    batch_wait_timeout_s: float = Field(0.005, ge=0)
    # Batches a replica may have in flight at once, and its ONNX Runtime worker threads: a
    # batch's length groups run side by side, and a batch forms while the previous one runs.
    max_concurrent_batches: int = Field(2, ge=1)
    # A batch is split into groups of similar text length: padding at most this many times the
    # real tokens of a group (0: only equal lengths share a call).
    max_padding_waste: float = Field(0.5, ge=0)
    # Whether the requests a batch gathers share ONNX Runtime calls. on: grouped by length;
    # off: one call per request, spread over the worker threads; auto: the replica measures at
    # start whether one call on 8 rows costs less than 8 calls on one row plus the thread
    # hand-offs (a small MLP or CNN gains, a wide Transformer on few cores loses), and chooses.
    calls: Literal["auto", "on", "off"] = "auto"


class GenerationConfig(Section):
    """`serve.generation`: a language model's replica (app/tasks/lm/replica.py)."""

    # Prompt tokens at most (and never beyond the model's window), `max_tokens` a request may
    # ask for and its default, and generations a replica runs at once (one more is a 503; the
    # decode loop steps them all together). A stream holds one of serve.max_ongoing_requests
    # while it runs: raise that too for more streams, or they queue in front of the replica.
    max_prompt_tokens: int = Field(1024, ge=1)
    max_tokens: int = Field(512, ge=1)
    default_max_tokens: int = Field(16, ge=1)
    max_streams: int = Field(16, ge=1)
    # Tokens one request may ask for in all (n x max_tokens): its decoding shares the one
    # decode thread with every other stream, and its answer body grows with it.
    max_request_tokens: int = Field(4096, ge=1)
    # KV-cache memory (MiB) the decode batch may hold: rows x the longest prompt + max_tokens
    # (rows are padded to it) x 2 (a step's outputs); a stream beyond it waits, then is a 503
    # (None: max_streams alone bounds it).
    max_kv_cache_mib: float | None = Field(None, gt=0)
    # A stream's text that comes within this many ms of its last event goes out with the next
    # one (the first at once): each event crosses from the replica to the routing app and out
    # as an SSE write, work that takes the replica's GIL from the decode loop (0: every token).
    stream_interval_ms: float = Field(40.0, ge=0)

    @model_validator(mode="after")
    def _default_fits(self) -> GenerationConfig:
        if self.default_max_tokens > self.max_tokens:
            raise ValueError(
                f"serve.generation.default_max_tokens ({self.default_max_tokens}) must not "
                f"exceed serve.generation.max_tokens ({self.max_tokens})"
            )
        return self


class ServeConfig(Section):
    app_name: str = "models"  # the Serve application routing to every model
    host: str = "127.0.0.1"  # where Serve's HTTP proxy listens
    port: int = Field(8000, ge=1, le=65535)  # Serve's HTTP port
    # auto: the variant export measured fastest at `batching.max_batch_size` rows among those
    # this process can run (ONNX fp32, ONNX int8, AOTInductor); aoti needs export.formats aoti.
    variant: Literal["auto", "fp32", "int8", "aoti"] = "int8"
    # Name of an environment variable holding the API key; when set there, every model route
    # needs `Authorization: Bearer <key>`. Required when `host` or the host Serve really listens
    # on (http_options.host) is not loopback (the rule: app.serve.http.gate.api_key).
    api_key_env: str = "RAYTORCH_API_KEY"
    # Rows after flattening: a text tensor of shape [1, N] is N rows.
    max_request_rows: int = Field(1024, ge=1)
    # How long the ingress waits for a model replica's answer before replying 504.
    request_timeout_s: float = Field(30.0, gt=0)
    max_body_bytes: int = Field(4 * 1024 * 1024, ge=1024)  # larger request bodies get a 413
    # Retrieval, each read from a picture's header before anything is decoded: the pixels a
    # sent picture may decode to (more is a 413: a small file can decode to gigabytes), its
    # longer side over its shorter (more is a 400: a shortest-edge resize scales the long side
    # with it), and the pixels of all the pictures of one request together (more is a 413).
    max_image_pixels: int = Field(4096 * 4096, ge=1)
    max_image_aspect: float = Field(20.0, ge=1)
    max_request_pixels: int = Field(64 * 2**20, ge=1)
    # Search: results per query, queries per request (max_request_rows, the rows any request
    # may carry, bounds them too) and results per request, queries x top_k (more of any is a
    # 413): a request's encoding time and its answer's size stay bounded.
    max_top_k: int = Field(100, ge=1)
    max_queries: int = Field(256, ge=1)
    max_search_results: int = Field(10_000, ge=1)
    batching: BatchingConfig = Field(default_factory=lambda: BatchingConfig())
    max_ongoing_requests: int = Field(16, ge=1)  # requests a model replica holds at once
    max_queued_requests: int = Field(64, ge=-1)  # waiting beyond that get a 503 (-1: unbounded)
    replica_cpus: float = Field(0.5, gt=0)  # CPUs per model replica
    replica_gpus: float = Field(0.0, ge=0)  # GPUs per model replica
    ingress_cpus: float = Field(0.25, gt=0)  # CPUs per replica of the routing application
    ingress_replicas: int = Field(1, ge=1)  # replicas of the routing application
    # The ingress only parses and forwards, so it can hold many requests at once; Serve's
    # default (5) would make it the bottleneck.
    ingress_max_ongoing_requests: int = Field(256, ge=1)
    health_check_period_s: float = Field(10.0, gt=0)  # Serve's replica health check period
    # A check that has not answered by then fails it (a replica failing 3 in a row is replaced).
    health_check_timeout_s: float = Field(30.0, gt=0)
    # A replica being stopped (downscaled, replaced, unhealthy) waits this long for its running
    # requests, then is killed: raise it for long generations, lower it to replace a wedged
    # replica sooner. Serve's default.
    graceful_shutdown_timeout_s: float = Field(20.0, gt=0)
    # Serve's per-request access log line in each model replica's log. Off by default: every
    # request is already counted in raytorch_requests_total (model, status) and Serve's own
    # request metrics, and the line costs a measurable share of a small model's request.
    access_log: bool = False
    generation: GenerationConfig = Field(default_factory=lambda: GenerationConfig())
    autoscaling: AutoscalingConfig = Field(default_factory=AutoscalingConfig)

    @model_validator(mode="after")
    def _batch_fits(self) -> ServeConfig:
        # A replica never holds more than max_ongoing_requests requests, so a larger batch
        # could never fill and would only add wait.
        if self.batching.max_batch_size > self.max_ongoing_requests:
            raise ValueError(
                f"serve.batching.max_batch_size ({self.batching.max_batch_size}) must not exceed "
                f"serve.max_ongoing_requests ({self.max_ongoing_requests})"
            )
        if self.autoscaling.min_replicas > self.autoscaling.max_replicas:
            raise ValueError("serve.autoscaling.min_replicas must not exceed max_replicas")
        return self

    def query_limit(self) -> tuple[str, int]:
        """The queries one search may carry, and the key that sets it: max_queries, or fewer
        when every request's rows (max_request_rows) are fewer."""
        if self.max_request_rows < self.max_queries:
            return "max_request_rows", self.max_request_rows
        return "max_queries", self.max_queries
