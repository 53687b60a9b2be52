"""A language model end to end without training time: a tiny random Qwen2 folder (a Llama-style
decoder with grouped-query attention, a tied head, ChatML and two end ids, written by
tools/make_tiny_pretrained.py) as a checkpoint on a real prepared corpus -> jobs.export's LM path
(KV-cache ONNX, int8, the gate) -> Ray Serve on a free port in the private Ray -> completions
over real HTTP (SSE framing, seeded determinism, 4xx naming the field, a disconnect stopping the
generation). GPT's own graph and decode are tests/unit/test_generate.py's."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time

import pytest
import requests
import torch

from app.config import dump
from app.errors import GateError
from app.export.exporter import export
from app.models import build_model, load_pretrained
from app.pipeline.stages import prepare
from app.runtime import artifact as art
from app.train.checkpoint import save
from app.train.preprocessing import fit_preprocessor
from tests.conftest import REPO, make_config

pytestmark = pytest.mark.integration

TINY = [
    "data.path={stdlib}/email/*.py",
    "data.val_fraction=0.15",
    # A long window, so that a generation lasts long enough for a client to leave mid-way.
    "model.max_length=512",
    "export.name=tinylm",
    "export.perplexity_rows=16",
    "export.greedy_prompts=4",
    "serve.generation.max_tokens=480",
    "serve.generation.max_prompt_tokens=256",
    "serve.generation.max_streams=2",
    "serve.autoscaling.min_replicas=1",
    "serve.autoscaling.max_replicas=1",
    # A wedged decode loop is found and its replica stopped within seconds (its test).
    "serve.health_check_period_s=1",
    "serve.health_check_timeout_s=2",
    "serve.graceful_shutdown_timeout_s=1",
]


@pytest.fixture(scope="module")
def lm_checkpoint(workspace):
    from tools.make_tiny_pretrained import make_decoder

    folder = make_decoder(
        str(workspace / "lm-serve" / "qwen2"), "qwen2", sizes={"max_position_embeddings": 1024}
    )
    overrides = [f"model.pretrained={folder}", *TINY]
    config = make_config(
        workspace / "lm-serve", *overrides, path=REPO / "configs" / "gpt2-finetune.yaml"
    )
    prepare(config)
    pre = fit_preprocessor(config)
    torch.manual_seed(0)
    model = build_model(config.model, pre)
    load_pretrained(model, pre)
    folder = str(workspace / "lm-serve" / "checkpoint")
    meta = {
        "config": dump(config),
        "epoch": 1,
        "step": 1,
        "metrics": {},
        "preprocessor": pre.to_json(),
    }
    save(folder, model, {}, meta)
    return config, folder


@pytest.fixture(scope="module")
def lm_artifact(lm_checkpoint):
    config, checkpoint = lm_checkpoint
    return config, export(config, checkpoint)


def test_export_writes_a_gated_kv_cache_artifact(lm_artifact):
    config, summary = lm_artifact
    artifact = art.open_artifact(summary["artifact"])
    assert artifact.schema["task"] == "lm"
    assert "tokenizer.json" in artifact.manifest.files  # hashed like every file
    report = summary["report"]
    assert report["parity"]["max_abs_diff"] <= config.export.parity_tolerance
    assert report["perplexity_increase"] <= config.export.max_perplexity_increase
    assert report["greedy"]["token_agreement"] >= config.export.min_greedy_agreement
    assert report["size_bytes"]["int8"] < report["size_bytes"]["fp32"]
    with open(os.path.join(artifact.uri, "report.json")) as f:
        assert json.load(f) == report


def test_jobs_predict_completes_each_row_as_the_endpoint_answers_it(
    lm_endpoint, lm_artifact, tmp_path
):
    """Prompts (greedy, seeded with a row's own temperature, a stop string), chat messages and
    bad rows in one JSON Lines file through batch inference, on the cluster that serves the
    model (its replicas hold CPUs the job's reads must do without): each good row's text,
    finish reason and token counts equal the online endpoint's answer to the same request."""
    import pyarrow.parquet as pq

    from app.config import load_config
    from app.predict.driver import predict
    from app.predict.write import verify_output

    chat = [{"role": "user", "content": "def"}]
    rows = [
        {"id": 1, "prompt": "def "},
        {"id": 2, "prompt": "import ", "temperature": 1.0, "seed": 7},
        {"id": 3, "prompt": "class ", "stop": ["e"], "temperature": None},
        {"id": 4, "messages": chat},
        {"id": 5, "prompt": ""},
        {"id": 6, "prompt": "x = ", "temperature": 5.0},
    ]
    lines = [json.dumps(r) for r in rows]
    (tmp_path / "rows.jsonl").write_text("\n".join([*lines, '{"id": 7, "prompt": 3}']) + "\n")
    config = load_config(
        None,
        [
            "predict.on_bad_rows=reject",
            "predict.generation.sampling={max_tokens: 12, temperature: 0}",
        ],
    )
    out = str(tmp_path / "out")
    predict(config, lm_artifact[1]["artifact"], str(tmp_path / "rows.jsonl"), out)
    manifest = verify_output(out)

    def read(shards) -> list[dict]:
        return [r for s in shards for r in pq.read_table(f"{out}/{s.file}").to_pylist()]

    assert {r["id"]: r["reason"].split(":")[0] for r in read(manifest.rejects)} == {
        "5": "column 'prompt'",
        "6": "column 'temperature'",
        "7": "column 'prompt'",
    }
    done = read(manifest.files)
    assert sorted(r["id"] for r in done) == [1, 2, 3, 4]
    for row in done:
        asked = {k: v for k, v in rows[row["id"] - 1].items() if k != "id" and v is not None}
        body = {"model": "tinylm", "max_tokens": 12, "temperature": 0, **asked}
        route = "chat/completions" if "messages" in asked else "completions"
        answer = requests.post(f"{lm_endpoint}/v1/{route}", json=body, timeout=60).json()
        choice = answer["choices"][0]
        text = choice["message"]["content"] if "messages" in asked else choice["text"]
        assert row["text"] == text, row
        assert row["finish_reason"] == choice["finish_reason"]
        usage = answer["usage"]
        assert (row["prompt_tokens"], row["completion_tokens"]) == (
            usage["prompt_tokens"],
            usage["completion_tokens"],
        )


def test_the_gate_refuses_and_publishes_nothing(lm_checkpoint, workspace):
    config, checkpoint = lm_checkpoint
    strict = config.model_copy(deep=True)
    strict.export.registry = str(workspace / "lm-serve" / "strict-registry")
    strict.export.max_perplexity_increase = 0.0
    strict.export.min_greedy_agreement = 1.0
    strict.export.max_size_ratio = 0.01  # int8 keeps its scales and norms: never this small
    with pytest.raises(GateError, match="export refused: int8 model is") as refused:
        export(strict, checkpoint)
    assert "\n" not in str(refused.value)
    assert not os.path.exists(strict.export.registry) or not os.listdir(strict.export.registry)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def lm_endpoint(lm_artifact):
    from ray import serve

    from app.serve.control.builders import run_local
    from tests.integration.conftest import ensure_local_ray

    config, summary = lm_artifact
    ensure_local_ray()
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    models = [{"name": "tinylm", "artifact": summary["artifact"]}]
    run_local(models, config.serve.model_dump(mode="json"))
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 60
    while requests.get(f"{url}/v2/health/ready", timeout=5).status_code != 200:
        assert time.time() < deadline, "the LM endpoint never became ready"
        time.sleep(0.5)
    yield url
    serve.shutdown()


def sse_events(response) -> list[str]:
    """The `data:` payloads of a Server-Sent-Events body, checking the framing on the way."""
    events = []
    for block in response.iter_lines(delimiter=b"\n\n"):
        if not block:
            continue
        assert block.startswith(b"data: "), block
        events.append(block[len(b"data: ") :].decode())
    return events


def completion(url: str, **fields):
    body = {"model": "tinylm", "prompt": "def ", "max_tokens": 12, **fields}
    return requests.post(
        f"{url}/v1/completions", json=body, stream=bool(fields.get("stream")), timeout=60
    )


def test_streamed_completion_is_sse_and_seeded_sampling_repeats(lm_endpoint):
    response = completion(lm_endpoint, stream=True, seed=7, temperature=1.0)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    events = sse_events(response)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "text_completion" and c["model"] == "tinylm" for c in chunks)
    last = chunks[-1]
    assert last["choices"][0]["finish_reason"] in ("length", "stop")
    usage = last["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    streamed = "".join(c["choices"][0]["text"] for c in chunks)
    # Not streamed, same seed: the same text and counts.
    whole = completion(lm_endpoint, seed=7, temperature=1.0).json()
    assert whole["choices"][0]["text"] == streamed
    assert whole["usage"] == usage
    # The Triton generate extension on the model's own route, greedy: stable.
    generate = f"{lm_endpoint}/v2/models/tinylm/generate"
    body = {"text_input": "def ", "parameters": {"max_tokens": 8, "temperature": 0}}
    answers = [requests.post(generate, json=body, timeout=60) for _ in range(2)]
    assert [a.status_code for a in answers] == [200, 200], answers[0].text
    first, second = (a.json() for a in answers)
    assert first["text_output"] == second["text_output"] and first["model_name"] == "tinylm"
    stream = requests.post(f"{generate}_stream", json=body, stream=True, timeout=60)
    pieces = [json.loads(e) for e in sse_events(stream)]
    assert "".join(p["text_output"] for p in pieces) == first["text_output"]
    assert pieces[-1]["finish_reason"] == first["finish_reason"]


@pytest.mark.parametrize(
    ("fields", "status", "named"),
    [
        ({"max_tokens": 10_000}, 400, "max_tokens"),
        ({"temperature": "hot"}, 400, "temperature"),
        ({"top_p": 0}, 400, "top_p"),
        ({"stop": [1]}, 400, "stop"),
        ({"prompt": "é" * 600}, 400, "prompt"),  # over serve.generation.max_prompt_tokens
        ({"model": "nope"}, 404, "nope"),
        ({"frequency_penalty": 3}, 400, "frequency_penalty"),
        ({"n": 5}, 400, "n"),
    ],
)
def test_bad_fields_get_a_4xx_naming_them(lm_endpoint, fields, status, named):
    response = completion(lm_endpoint, **fields)
    assert response.status_code == status
    error = response.json()["error"]  # OpenAI's error shape on its routes
    assert named in error["message"] and error["type"] == "invalid_request_error"


def generation_stats(url: str) -> dict[str, int]:
    return requests.get(f"{url}/v2/models/tinylm", timeout=10).json()["parameters"]["generation"]


def assert_cancelled_once(url: str, before: dict[str, int]) -> None:
    """One more generation was cancelled, before its 480 tokens, and none runs any longer."""
    deadline = time.time() + 20
    while (stats := generation_stats(url))["active"] and time.time() < deadline:
        time.sleep(0.2)
    assert stats["active"] == 0
    assert stats["cancelled"] == before["cancelled"] + 1
    assert stats["tokens"] - before["tokens"] < 480


def test_a_client_that_disconnects_stops_its_generation(lm_endpoint):
    before = generation_stats(lm_endpoint)
    # A long greedy generation (the cap, 480 tokens); the client reads one chunk and leaves.
    response = completion(lm_endpoint, stream=True, max_tokens=480, temperature=0.0)
    lines = response.iter_lines(delimiter=b"\n\n")
    next(lines)  # the first chunk is there: the generation runs
    running = generation_stats(lm_endpoint)
    assert running["active"] == 1 and running["kv_cache_tokens"] > 0  # the prompt at least
    response.close()  # the client goes away
    assert_cancelled_once(lm_endpoint, before)
    assert generation_stats(lm_endpoint)["kv_cache_tokens"] == 0  # its cache is let go


def test_int8_greedy_tokens_are_the_same_alone_and_batched(lm_artifact):
    """The served int8 graph has int8 weights and fp32 activations: a sequence's logits do not
    depend on the other sequences in the call (per-call activation scales made them)."""
    import numpy as np

    from app.runtime.kv import KVDecoder, greedy

    _, summary = lm_artifact
    artifact = art.open_artifact(summary["artifact"])
    assert artifact.report["quantization"]["batch_independent"] is True
    decoder = KVDecoder(artifact.session("int8", 1))
    prompts = np.random.default_rng(0).integers(0, decoder.vocab_size, (8, 24))
    prefill, cache = decoder.step(prompts, decoder.empty_cache(len(prompts)))
    tokens = [prefill[:, -1].argmax(-1)]
    for _ in range(11):  # greedy, all eight sequences in every call
        logits, cache = decoder.step(tokens[-1][:, None], cache)
        tokens.append(logits[:, -1].argmax(-1))
    batched = np.stack(tokens, axis=1)
    for i, prompt in enumerate(prompts):
        alone, _ = decoder.step(prompt[None], decoder.empty_cache())
        assert np.abs(alone[0] - prefill[i]).max() < 1e-5
        assert greedy(decoder, prompt.tolist(), 12) == batched[i].tolist()


def test_a_whole_completion_whose_client_leaves_has_its_generation_cancelled(lm_endpoint):
    """Not streamed: the client gives up while its generation runs, before the answer; the
    replica stops generating."""
    import http.client
    from urllib.parse import urlsplit

    before = generation_stats(lm_endpoint)
    body = {"model": "tinylm", "prompt": "def ", "max_tokens": 480, "temperature": 0.0}
    client = http.client.HTTPConnection(urlsplit(lm_endpoint).netloc, timeout=30)
    client.request(
        "POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"}
    )
    # Left once the generation runs (a client leaving earlier may never reach the replica).
    deadline = time.time() + 20
    while not generation_stats(lm_endpoint)["active"]:
        assert time.time() < deadline, "the generation never started"
        time.sleep(0.02)
    client.close()  # the client goes away without reading the answer
    assert_cancelled_once(lm_endpoint, before)


def test_a_stream_whose_model_call_fails_is_an_error_and_its_batch_mate_finishes(lm_endpoint):
    """Injected faults (tests/fault_hooks.py, by seed) in the replica's decode loop: a stream
    whose model calls fail after two tokens is a 500 in OpenAI's shape (whole) or an error
    event and [DONE] (streamed), while the stream stepped beside it gets its whole answer; a
    join without memory is a 503 with Retry-After; slots and the KV budget return to zero."""
    from concurrent.futures import ThreadPoolExecutor

    from tests.fault_hooks import FAIL_SEED, MEMORY_SEED

    greedy_long = {"max_tokens": 96, "temperature": 0.0}
    alone = completion(lm_endpoint, **greedy_long).json()["choices"][0]["text"]
    with ThreadPoolExecutor(2) as pool:
        mate = pool.submit(completion, lm_endpoint, **greedy_long)
        failed = pool.submit(completion, lm_endpoint, seed=FAIL_SEED, max_tokens=96)
        mate, failed = mate.result(), failed.result()
    assert mate.status_code == 200 and mate.json()["choices"][0]["text"] == alone
    assert failed.status_code == 500, failed.text
    error = failed.json()["error"]
    assert error["type"] == "server_error" and "tinylm" in error["message"]
    assert "Traceback" not in failed.text
    streamed = completion(lm_endpoint, seed=FAIL_SEED, max_tokens=96, stream=True)
    assert streamed.status_code == 200
    events = sse_events(streamed)
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == 500
    # Never a finish_reason for a stream that did not finish (its two tokens' text comes before
    # the error, unless the tokens end inside a character: a random model's often do).
    reasons = [c["choices"][0]["finish_reason"] for c in map(json.loads, events[:-2])]
    assert all(reason is None for reason in reasons), reasons
    refused = completion(lm_endpoint, seed=MEMORY_SEED)
    assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
    stats = generation_stats(lm_endpoint)
    assert stats["failed"] == 3
    assert stats["active"] == stats["kv_cache_tokens"] == stats["kv_reserved_tokens"] == 0


def test_a_wedged_decode_loop_fails_its_health_check_and_is_replaced(lm_endpoint):
    """A stream whose model call never returns wedges the replica's decode thread; the health
    check steps through the loop, fails (serve.health_check_timeout_s), and Serve replaces the
    replica, which answers again."""
    from tests.fault_hooks import WEDGE_SEED

    before = replica_pids()
    # No answer until the replica is gone, then an error or a closed connection.
    with contextlib.suppress(requests.exceptions.ConnectionError):
        assert completion(lm_endpoint, seed=WEDGE_SEED, max_tokens=4).status_code >= 500
    wait_for_answer(lm_endpoint, 60)
    assert replica_pids() and not replica_pids() & before


def replica_pids() -> set[int]:
    import psutil

    return {
        p.pid
        for p in psutil.process_iter(["cmdline"])
        if "ServeReplica:models-tinylm" in " ".join(p.info["cmdline"] or [])
    }


def wait_for_answer(url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if completion(url, max_tokens=2).status_code == 200:
                return
        except requests.exceptions.RequestException:
            pass
        time.sleep(0.5)
    raise AssertionError(f"no replica answered within {timeout_s} s")


def test_a_replica_killed_mid_stream_ends_the_stream_and_is_replaced(lm_endpoint):
    """The stream's client gets an end (its connection closes) within a second of the kill,
    never a hang; Serve starts a replacement that answers again. Runs last in this module."""
    import signal

    response = completion(lm_endpoint, stream=True, max_tokens=480, temperature=0.0)
    lines = response.iter_lines(delimiter=b"\n\n")
    next(lines)
    [pid] = replica_pids()
    os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    try:
        for _ in lines:  # whatever arrives before the connection closes
            pass
    except requests.exceptions.RequestException:
        pass
    ended = time.monotonic() - killed
    assert ended < 1.0, ended
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if completion(lm_endpoint, max_tokens=2).status_code == 200:
                break
        except requests.exceptions.RequestException:
            pass
        time.sleep(0.5)
    else:
        raise AssertionError("no replica answered within 60 s of the kill")


# --- OpenAI's own Python client against the endpoint ---------------------------------------------


@pytest.fixture(scope="module")
def openai_client(lm_endpoint):
    import openai

    return openai.OpenAI(base_url=f"{lm_endpoint}/v1", api_key="unused", max_retries=0)


def test_openai_client_completions_whole_and_streamed_with_usage(openai_client):
    whole = openai_client.completions.create(
        model="tinylm", prompt="def ", max_tokens=12, temperature=0
    )
    text = whole.choices[0].text
    assert text and whole.choices[0].finish_reason in ("stop", "length")
    assert whole.usage.completion_tokens > 0 and whole.usage.prompt_tokens > 0
    chunks = list(
        openai_client.completions.create(
            model="tinylm",
            prompt="def ",
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text  # greedy: the same
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage  # OpenAI's usage chunk
    assert all(c.usage is None for c in chunks[:-1])


def test_openai_client_chat_completions_whole_and_streamed(openai_client):
    messages = [
        {"role": "system", "content": "You write Python."},
        {"role": "user", "content": "def "},
    ]
    whole = openai_client.chat.completions.create(
        model="tinylm", messages=messages, max_completion_tokens=10, temperature=0
    )
    message = whole.choices[0].message
    assert whole.object == "chat.completion" and message.role == "assistant" and message.content
    stream = openai_client.chat.completions.create(
        model="tinylm", messages=messages, max_tokens=10, temperature=0, stream=True
    )
    deltas = [c.choices[0].delta.content or "" for c in stream]
    assert "".join(deltas) == message.content


def test_openai_client_logprobs_rank_the_greedy_token_first_whole_and_streamed(openai_client):
    """Greedy decoding picks the likeliest token: each reported token is its position's top
    alternative, the alternatives come likeliest first, and the tokens spell the text."""
    whole = openai_client.completions.create(
        model="tinylm", prompt="def ", max_tokens=10, temperature=0, logprobs=3
    )
    choice = whole.choices[0]
    lp = choice.logprobs
    assert len(lp.tokens) == whole.usage.completion_tokens
    # Tokens spell the text, but for a token that ends inside a character (it reads U+FFFD,
    # and the byte tokens of one split character all start where that character does).
    offsets = lp.text_offset
    assert offsets[0] == 0 and offsets == sorted(offsets) and offsets[-1] <= len(choice.text)
    if "\ufffd" not in "".join(lp.tokens):
        assert "".join(lp.tokens) == choice.text
        assert offsets == [sum(map(len, lp.tokens[:i])) for i in range(len(lp.tokens))]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        ranked = sorted(top.values(), reverse=True)
        # Three alternatives (fewer keys when two read the same, as split bytes do).
        assert 1 <= len(top) <= 3 and logprob <= 0 and logprob == pytest.approx(ranked[0])
        assert top[token] == pytest.approx(logprob)
    streamed = openai_client.completions.create(
        model="tinylm", prompt="def ", max_tokens=10, temperature=0, logprobs=3, stream=True
    )
    chunks = [c.choices[0].logprobs for c in streamed if c.choices and c.choices[0].logprobs]
    assert [t for chunk in chunks for t in chunk.tokens] == lp.tokens
    chat = openai_client.chat.completions.create(
        model="tinylm",
        messages=[{"role": "user", "content": "def "}],
        max_completion_tokens=8,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = chat.choices[0].logprobs.content
    spelled = bytes(b for t in content for b in t.bytes).decode("utf-8", "replace")
    assert spelled == chat.choices[0].message.content
    assert all(t.top_logprobs[0].token == t.token and len(t.top_logprobs) == 2 for t in content)


def test_openai_client_stop_cuts_and_a_seed_repeats(openai_client):
    """A seed repeats a sampled completion; the same completion with a stop string taken from
    its second half ends just before it, finish_reason stop."""

    def complete(**fields):
        return openai_client.completions.create(
            model="tinylm", prompt="import ", max_tokens=16, temperature=1.0, seed=11, **fields
        ).choices[0]

    first, second = complete().text, complete().text
    assert first == second
    half = len(first) // 2
    stop = next(first[i : i + 3] for i in range(half, len(first) - 2) if first[i : i + 3].strip())
    cut = complete(stop=[stop])
    assert cut.text == first[: first.index(stop)] and cut.finish_reason == "stop"


def test_openai_client_gets_a_400_naming_a_parameter_that_would_change_the_output(openai_client):
    import openai

    with pytest.raises(openai.BadRequestError) as info:
        openai_client.completions.create(model="tinylm", prompt="def ", logit_bias={"1": 5})
    assert "logit_bias" in str(info.value)
    with pytest.raises(openai.BadRequestError) as info:
        openai_client.chat.completions.create(
            model="tinylm", messages=[{"role": "user", "content": "hi"}], tools=[]
        )
    assert "tools" in str(info.value)


def test_openai_client_n_choices_echo_penalties_and_the_model_list(openai_client):
    """n completions are n generations (choice i sampled with seed + i), whole and streamed;
    echo puts the prompt first; penalties change greedy decoding; models.list() reads the
    OpenAI half of /v1/models."""

    def create(**kw):
        return openai_client.completions.create(
            **{"model": "tinylm", "prompt": "def ", "max_tokens": 8, **kw}
        )

    single = {seed: create(temperature=1.0, seed=seed).choices[0].text for seed in (3, 4)}
    whole = create(temperature=1.0, seed=3, n=2, echo=True)
    assert [c.index for c in whole.choices] == [0, 1]
    assert [c.text for c in whole.choices] == ["def " + single[3], "def " + single[4]]
    usage = whole.usage
    assert (
        usage.completion_tokens > 0
        and usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    )
    streamed, finished = {0: "", 1: ""}, set()
    for chunk in create(temperature=1.0, seed=3, n=2, stream=True):
        for choice in chunk.choices:
            streamed[choice.index] += choice.text
            finished |= {choice.index} if choice.finish_reason else set()
    assert streamed == {0: single[3], 1: single[4]} and finished == {0, 1}
    greedy = create(temperature=0, max_tokens=48).choices[0].text
    penalized = create(temperature=0, max_tokens=48, frequency_penalty=2.0, presence_penalty=2.0)
    assert penalized.choices[0].text != greedy
    assert "tinylm" in [model.id for model in openai_client.models.list()]


def test_concurrent_streams_share_the_decode_loop_and_keep_their_answers(lm_endpoint):
    """Two greedy completions at once (serve.generation.max_streams here) are stepped together
    by the replica's decode loop and each gets the text it gets alone."""
    from concurrent.futures import ThreadPoolExecutor

    def text(prompt: str) -> str:
        answer = completion(lm_endpoint, prompt=prompt, max_tokens=96, temperature=0.0)
        assert answer.status_code == 200, answer.text
        return answer.json()["choices"][0]["text"]

    prompts = ["def ", "import "]
    alone = [text(p) for p in prompts]
    with ThreadPoolExecutor(2) as pool:
        together = list(pool.map(text, prompts))
    assert together == alone
    assert generation_stats(lm_endpoint)["batch_peak"] >= 2  # (a health probe may join them)


def test_a_stream_beyond_the_kv_cache_budget_is_a_503_until_room_is_freed(lm_artifact):
    """A replica (the real LMServer and ONNX Runtime, in this process) with room in its KV-cache
    budget for one 300-token stream: a second waits, is refused with a 503 and Retry-After
    while the first runs, and starts once it ended."""
    import asyncio

    from app.runtime.types import GenerationRequest, RequestError, Started
    from app.tasks.lm.replica import LMServer

    config, summary = lm_artifact
    cfg = config.serve.model_copy(deep=True)
    # tinylm: 256 bytes a token (2 blocks x 2 key/value heads of 8 floats, keys and values);
    # one 300-token stream and a step's outputs need about 0.15 MiB, two about 0.3.
    cfg.generation.max_kv_cache_mib = 0.2
    cfg.request_timeout_s = 0.5  # a stream waits for room up to half of it, then is a 503

    def request():
        return GenerationRequest("def ", {"max_tokens": 300, "temperature": 0.0})

    async def scenario():
        server = LMServer(summary["artifact"], cfg)
        first = server.generate(request())
        assert isinstance(await anext(first), Started)  # its tokens are reserved
        second = server.generate(request())
        with pytest.raises(RequestError) as refused:
            await anext(second)
        await first.aclose()  # the first stream ends: its reservation is released
        third = server.generate(request())
        assert isinstance(await anext(third), Started)
        await third.aclose()
        return refused.value

    refused = asyncio.run(scenario())
    assert refused.status == 503 and refused.retry_after_s == 1
    assert "max_kv_cache_mib" in refused.message


def test_a_generated_token_enters_few_project_functions(lm_artifact):
    """The steady path of one token, traced through the in-process app (a streamed chat
    request, the replica's decode loop and its HTTP stack) with a profiler on every thread:
    the project functions entered once per generated token or more. With the stream interval
    the route and its encoders run once per event, not per token; what is left is the decode
    step: the loop, the KV step, sampling, the stream's text and its hand-off."""
    import asyncio

    import httpx

    from app import hooks
    from app.config import ServeConfig
    from app.serve.http.api import create_api
    from app.serve.http.clients import LocalModel, Models
    from app.serve.http.gate import IngressMetrics
    from app.tasks.lm.replica import LMServer
    from tests.integration.test_request_depth import tracing

    config, summary = lm_artifact
    # Before the decode loop's thread starts, and as production runs it (no test hook).
    with hooks.none_installed(), tracing() as (entered, recording):
        cfg = ServeConfig()
        server = LMServer(summary["artifact"], cfg)
        api = create_api(
            cfg, Models.configured({"tinylm": LocalModel(server)}, cfg), IngressMetrics()
        )
        body = {
            "model": "tinylm",
            "messages": [{"role": "user", "content": "def "}],
            "max_tokens": 40,
            "temperature": 1.0,
            "seed": 3,
            "stream": True,
            "stream_options": {"include_usage": True},
        }

        async def requests_() -> dict:
            transport = httpx.ASGITransport(app=api)
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
                assert (await http.post("/v1/chat/completions", json=body)).status_code == 200
                recording.set()
                answer = await http.post("/v1/chat/completions", json=body)
                recording.clear()
                assert answer.status_code == 200, answer.text
            events = [e for e in answer.text.split("\n\n") if e.startswith("data: {")]
            return json.loads(events[-1].removeprefix("data: "))["usage"]

        usage = asyncio.run(requests_())
    tokens = usage["completion_tokens"]
    assert tokens >= 10, usage
    per_token = sorted(where for where, calls in entered.items() if calls >= tokens - 1)
    modules = {module for module, _ in per_token}
    listing = "\n".join(f"{m}:{f}" for m, f in per_token)
    assert len(per_token) <= MAX_FUNCTIONS_PER_TOKEN, f"{len(per_token)} functions:\n{listing}"
    assert len(modules) <= MAX_MODULES_PER_TOKEN, f"{len(modules)} modules: {sorted(modules)}"


# The decode step: the loop (step, hand-off), the KV cache's step, and the stream's decoding
# (sampler, text).
MAX_FUNCTIONS_PER_TOKEN = 10
MAX_MODULES_PER_TOKEN = 3


def test_an_index_of_no_models_lists_none_with_a_200(lm_endpoint, lm_artifact):
    """What `jobs.models undeploy` leaves after the last model: the index with an empty list,
    as OpenAI's client expects it (not a 404)."""
    from ray import serve

    from app.serve.control.builders import applications, build_index_app, run_local

    config, summary = lm_artifact
    serve_config = config.serve.model_dump(mode="json")
    [index] = applications([], serve_config)  # the index alone, listing no model
    serve.run(build_index_app(index["args"]), name=index["name"], route_prefix="/")
    try:
        r = requests.get(f"{lm_endpoint}/v1/models", timeout=30)
        assert r.status_code == 200, r.text
        assert r.json()["data"] == [] and r.json()["models"] == []
    finally:  # the module's index back
        run_local([{"name": "tinylm", "artifact": summary["artifact"]}], serve_config)
