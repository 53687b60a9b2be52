"""Retrieval served on the suite's cluster (cluster/start.sh: HAProxy and Serve's gRPC transport
between deployments), in make test: one small from-scratch retrieval pipeline (the README's
`configs/retrieval.yaml`, shortened) deploys a model and its index, and a second index whose
items carry about a kilobyte of metadata each (and a binary column, answered base64) makes the
largest answer the search caps allow.

Hostile and careless requests get a 4xx naming what is wrong, never a 5xx; a request that could
take a replica's memory is refused before it costs any (the replica's PSS, read by pid, stays
within 100 MB of its idle size) and a good request is served by the same replica right after;
every request the HTTP limits admit, and the largest answer, succeed. Search by text, stored
id and filter; OpenAI's client; the listing; the search page in a real headless chromium; and,
last, a new index version deployed under load without a failed answer."""

from __future__ import annotations

import base64
import io
import json
import os
import re
import threading
import time

import numpy as np
import pytest
import requests

from tests.e2e.conftest import DASHBOARD, SERVE, ClosedLoop, run_job

pytestmark = pytest.mark.e2e

TINY = [
    "data.num_rows=200",
    "train.epochs=2",
    "train.num_workers=1",
    "train.cpus_per_worker=0.5",
    "serve.autoscaling.max_replicas=1",
    "serve.replica_cpus=0.25",
    "predict.actor_cpus=0.25",
    "predict.max_actors=1",
]
EMBED = f"{SERVE}/v1/embeddings"
SEARCH = f"{SERVE}/v1/models/retrieval-index:search"
NOTES = f"{SERVE}/v1/models/retrieval-notes:search"
NOTE_BYTES = 1000  # each item of the notes index: a search at the caps answers > 4 MiB
HTML_NOTE = '<b>bold</b><img src=x onerror="window.injected=1">'


@pytest.fixture(scope="module")
def served(cluster, tmp_path_factory):
    """The retrieval pipeline on the suite's cluster, then an index of the same encoder over
    120 captions carrying a kilobyte note each (jobs.predict -> jobs.index -> jobs.deploy)."""
    import pandas as pd

    root = tmp_path_factory.mktemp("retrieval-serve")
    paths = [
        f"data.output={root}/data",
        f"train.storage_path={root}/runs",
        f"export.registry={root}/registry",
    ]
    config = ["--config", "configs/retrieval.yaml", *paths, *TINY]
    summary = run_job("pipeline", *config)
    corpus = root / "notes.parquet"
    pd.DataFrame(
        {
            "id": [f"note-{i}" for i in range(120)],
            "caption": [f"a small red circle number {i}" for i in range(120)],
            "note": [f"{i:04d}" + "n" * (NOTE_BYTES - 4) for i in range(120)],
            "blob": [bytes([i, 0, 255]) for i in range(120)],  # binary: a 500 in search once
            "html": [HTML_NOTE] * 120,  # shown as text by the search page
        }
    ).to_parquet(corpus)
    artifact = summary["stages"]["export"]["artifact"]
    out = str(root / "notes-embeddings")
    run_job("predict", *config, "--artifact", artifact, "--input", str(corpus), "--output", out)
    index = run_job("index", *config, "--embeddings", out, "index.name=retrieval-notes")
    run_job("deploy", *config, "--artifact", index["artifact"])
    return {"summary": summary, "root": root, "config": config}


def png(width: int, height: int, noise: bool = False, seed: int = 0) -> bytes:
    from PIL import Image

    if noise:
        pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), np.uint8)
        img = Image.fromarray(pixels, "RGB")
    else:
        img = Image.new("L", (width, height))
    buffer = io.BytesIO()
    img.save(buffer, format="PNG")
    return buffer.getvalue()


def picture(data: bytes, mime: str = "image/png") -> dict:
    url = f"data:{mime};base64," + base64.b64encode(data).decode()
    return {"type": "image_url", "image_url": {"url": url}}


def pss_mb(pid: int) -> float:
    """A process's proportional set size (its share of every page it maps), in MB."""
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            if line.startswith("Pss:"):
                return int(line.split()[1]) / 1024
    raise AssertionError(f"no Pss in /proc/{pid}/smaps_rollup")


class PeakPss:
    """The largest PSS of a process, sampled every 20 ms while the block runs."""

    def __init__(self, pid: int):
        self.pid, self.peak = pid, pss_mb(pid)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, pss_mb(self.pid))

    def __enter__(self) -> PeakPss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, pss_mb(self.pid))


def error_of(r: requests.Response) -> str:
    """The refusal's message: OpenAI's error object on /v1/embeddings, a string elsewhere."""
    error = r.json()["error"]
    return error["message"] if isinstance(error, dict) else error


def good(url: str) -> requests.Response:
    body = (
        {"model": "retrieval", "input": ["a red circle", picture(png(32, 32))]}
        if url == EMBED
        else {"query": {"text": "a red circle"}, "top_k": 3}
    )
    r = requests.post(url, json=body, timeout=30)
    assert r.status_code == 200, r.text
    return r


SLIVER = png(4_194_304, 4)  # 16 Mpx: within max_image_pixels, 234 Mpx once resized by CLIP
BIG_BLANK = png(4096, 4096)  # exactly serve.max_image_pixels: one is fine, 40 are 671 Mpx
COSTLY = [
    (
        "an extreme aspect ratio",
        EMBED,
        {"model": "retrieval", "input": [picture(SLIVER)]},
        400,
        "input[0]: 4194304x4 pixels, an aspect ratio of 1.049e+06, over serve.max_image_aspect=20",
    ),
    (
        "40 pictures of 4096x4096",
        EMBED,
        {"model": "retrieval", "input": ["fine", *[picture(BIG_BLANK)] * 40]},
        413,
        "input: 40 pictures of 671088640 pixels together, more than serve.max_request_pixels",
    ),
    (
        "20,000 text queries",
        SEARCH,
        {"queries": [{"text": f"a red circle {i}"} for i in range(20_000)]},
        413,
        "queries: 20000 queries, more than serve.max_queries=256",
    ),
    (
        "an extreme aspect ratio as a query",
        SEARCH,
        {"query": {"image": picture(SLIVER)["image_url"]["url"]}},
        400,
        "queries[0].image: 4194304x4 pixels",
    ),
]


@pytest.mark.parametrize(
    "url, body, status, message", [c[1:] for c in COSTLY], ids=[c[0] for c in COSTLY]
)
def test_a_costly_request_is_refused_before_it_costs_the_replica_memory(
    served, url, body, status, message
):
    pid = int(good(url).headers["x-model-replica"])
    idle = pss_mb(pid)
    with PeakPss(pid) as memory:  # while it refuses, not only after
        r = requests.post(url, json=body, timeout=60)
    assert (r.status_code, error_of(r)[: len(message)]) == (status, message), r.text
    assert memory.peak - idle < 100, (idle, memory.peak)
    assert int(good(url).headers["x-model-replica"]) == pid  # the same replica, still serving


def test_the_largest_body_the_http_limits_admit_is_embedded(served):
    """A body just under serve.max_body_bytes (4 MiB) of pictures: over the 4 MiB gRPC default
    between the routing and the model replica once framed, it came back a retryable 503."""
    pictures = [png(590, 590, noise=True, seed=s) for s in range(3)]
    body = json.dumps({"model": "retrieval", "input": [picture(p) for p in pictures]})
    assert 4 * 2**20 - 40_000 < len(body) <= 4 * 2**20, len(body)
    r = requests.post(EMBED, data=body, headers={"Content-Type": "application/json"}, timeout=60)
    assert r.status_code == 200, r.text[:300]
    assert len(r.json()["data"]) == 3


def test_the_largest_answer_the_search_caps_allow_is_served(served):
    """100 queries x top_k 100 (serve.max_search_results) over items of a kilobyte of metadata:
    about 10 MB between the index replica and the routing one (4 MiB was the gRPC limit)."""
    body = {"queries": [{"id": f"note-{i}"} for i in range(100)], "top_k": 100}
    r = requests.post(NOTES, json=body, timeout=60)
    assert r.status_code == 200, r.text[:300]
    results = r.json()["results"]
    assert len(results) == 100 and all(len(hits) == 100 for hits in results)
    assert len(r.content) > 10 * NOTE_BYTES * 1000
    # An item finds itself at the top score (captions this alike may tie with it).
    [own] = [h for h in results[7] if h["id"] == "note-7"]
    assert own["score"] == pytest.approx(results[7][0]["score"], abs=1e-5)
    assert own["metadata"]["note"].startswith("0007") and len(own["metadata"]["note"]) == NOTE_BYTES
    assert own["metadata"]["blob"] == base64.b64encode(bytes([7, 0, 255])).decode()
    over = requests.post(
        NOTES, json={**body, "queries": body["queries"] + [{"id": "x"}]}, timeout=30
    )
    assert over.status_code == 413 and "serve.max_search_results=10000" in over.text


REMOTE = {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}
M = {"model": "retrieval"}
DIM = 64  # configs/retrieval.yaml's model.embed_dim
HOSTILE = [
    # /v1/embeddings: what a picture is
    ("remote image URL", EMBED, {**M, "input": ["a cat", REMOTE]}, 400, "input[1]"),
    ("corrupt picture", EMBED, {**M, "input": [picture(b"\x89PNG\r\n\x1a\nno")]}, 400, "input[0]"),
    ("a picture that is text", EMBED, {**M, "input": [picture(b"hello")]}, 400, "input[0]"),
    (
        "decompression bomb",
        EMBED,
        {**M, "input": ["ok", picture(png(9000, 8000))]},
        413,
        "input[1]",
    ),
    ("a tall sliver", EMBED, {**M, "input": [picture(png(4, 5000))]}, 400, "max_image_aspect"),
    (
        "not base64",
        EMBED,
        {**M, "input": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,@@"}}]},
        400,
        "input[0]",
    ),
    (
        "not an image type",
        EMBED,
        {**M, "input": [picture(png(8, 8), "text/plain")]},
        400,
        "input[0]",
    ),
    (
        "an image part without url",
        EMBED,
        {**M, "input": [{"type": "image_url", "image_url": {}}]},
        400,
        "input[0]",
    ),
    (
        "an unknown part type",
        EMBED,
        {**M, "input": [{"type": "audio", "audio": "x"}]},
        400,
        "input[0]",
    ),
    # /v1/embeddings: types, counts, fields
    ("empty string", EMBED, {**M, "input": ["fine", ""]}, 400, "input[1]"),
    ("empty list", EMBED, {**M, "input": []}, 400, "input"),
    ("a number", EMBED, {**M, "input": 42}, 400, "input"),
    ("token ids", EMBED, {**M, "input": [[1, 2, 3]]}, 400, "input[0]"),
    ("nested lists", EMBED, {**M, "input": [["a", ["b"]]]}, 400, "input[0]"),
    ("1,025 inputs", EMBED, {**M, "input": ["a"] * 1025}, 413, "serve.max_request_rows=1024"),
    ("a lone surrogate", EMBED, {**M, "input": ["\ud800"]}, 400, "input"),
    ("dimensions", EMBED, {**M, "input": "a cat", "dimensions": 8}, 400, "dimensions"),
    (
        "an unknown encoding",
        EMBED,
        {**M, "input": "a", "encoding_format": "int8"},
        400,
        "encoding_format",
    ),
    ("no model", EMBED, {"input": "a cat"}, 400, "model"),
    ("an unknown model", EMBED, {"model": "no-such-model", "input": "a"}, 404, "no-such-model"),
    (
        "a model that is an index",
        EMBED,
        {"model": "retrieval-index", "input": "a"},
        400,
        "retrieval-index",
    ),
    # :search
    ("top_k over the limit", SEARCH, {"query": {"text": "a"}, "top_k": 10**6}, 413, "top_k"),
    ("top_k zero", SEARCH, {"query": {"text": "a"}, "top_k": 0}, 400, "top_k"),
    ("top_k a string", SEARCH, {"query": {"text": "a"}, "top_k": "5"}, 400, "top_k"),
    ("wrong dimension", SEARCH, {"query": {"embedding": [0.1] * 3}}, 400, "embedding"),
    ("a zero vector", SEARCH, {"query": {"embedding": [0.0] * DIM}}, 400, "embedding"),
    ("a vector of strings", SEARCH, {"query": {"embedding": ["1"] * DIM}}, 400, "embedding"),
    ("unknown filter field", SEARCH, {"query": {"text": "a"}, "filter": {"nope": 1}}, 400, "nope"),
    (
        "base64 that does not decode",
        SEARCH,
        {"query": {"embedding": "!!!!"}, "encoding_format": "base64"},
        400,
        "does not decode",
    ),
    (
        "base64 of no float32 vector",
        SEARCH,
        {"query": {"embedding": "YWJj"}, "encoding_format": "base64"},
        400,
        "not a float32 vector",
    ),
    ("a base64 string sent as floats", SEARCH, {"query": {"embedding": "AACAPw=="}}, 400, "base64"),
    (
        "a filter value that is a list",
        SEARCH,
        {"query": {"text": "a"}, "filter": {"caption": [1]}},
        400,
        "filter",
    ),
    ("unknown stored id", SEARCH, {"query": {"id": "no-such-item"}}, 404, "queries[0].id"),
    ("remote search picture", SEARCH, {"query": {"image": "http://x/y.png"}}, 400, "image"),
    (
        "a bomb as a query",
        SEARCH,
        {"query": {"image": picture(png(9000, 8000))["image_url"]["url"]}},
        413,
        "queries[0].image",
    ),
    ("two kinds in one query", SEARCH, {"query": {"text": "a", "id": "x"}}, 400, "exactly one"),
    (
        "query and queries",
        SEARCH,
        {"query": {"text": "a"}, "queries": [{"text": "b"}]},
        400,
        "queries",
    ),
    ("no queries", SEARCH, {"queries": []}, 400, "queries"),
    ("a query that is a string", SEARCH, {"queries": ["a red circle"]}, 400, "queries[0]"),
    ("an unknown query field", SEARCH, {"query": {"txt": "a"}}, 400, "txt"),
    (
        "queries x top_k over the cap",
        SEARCH,
        {"queries": [{"id": "x"}] * 200, "top_k": 100},
        413,
        "serve.max_search_results",
    ),
    (
        "an unknown index",
        f"{SERVE}/v1/models/no-such-index:search",
        {"query": {"text": "a"}},
        404,
        "no-such-index",
    ),
]


@pytest.mark.parametrize(
    "url, body, status, named", [h[1:] for h in HOSTILE], ids=[h[0] for h in HOSTILE]
)
def test_hostile_inputs_get_a_4xx_naming_them(served, url, body, status, named):
    r = requests.post(url, json=body, timeout=60)
    assert r.status_code == status, r.text[:300]
    assert named in r.text, r.text[:300]


RAW = [
    ("not JSON", b"{not json", "application/json", 400),
    ("a JSON array", b"[1, 2]", "application/json", 400),
    ("NaN", b'{"model": "retrieval", "input": NaN}', "application/json", 400),
    (
        "deeply nested",
        b'{"model": "retrieval", "input": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
        "application/json",
        400,
    ),
    (
        "over max_body_bytes",
        b'{"model": "retrieval", "input": "' + b"a" * (4 * 2**20) + b'"}',
        "application/json",
        413,
    ),
    ("text/plain", b'{"model": "retrieval", "input": "a"}', "text/plain", 415),
]


@pytest.mark.parametrize(
    "body, content_type, status", [r[1:] for r in RAW], ids=[r[0] for r in RAW]
)
def test_malformed_bodies_get_a_4xx_and_the_replicas_keep_serving(
    served, body, content_type, status
):
    for url in (EMBED, SEARCH):
        r = requests.post(url, data=body, headers={"Content-Type": content_type}, timeout=60)
        assert r.status_code == status, (url, r.text[:300])
    good(EMBED), good(SEARCH)


def guide_curl_lines() -> list[str]:
    """The `curl` commands of docs/guide.md's retrieval block, continuation lines joined."""
    from pathlib import Path

    guide = (Path(__file__).resolve().parents[2] / "docs" / "guide.md").read_text()
    block = guide.split("<!-- retrieval-curl -->", 1)[1].split("```bash\n", 1)[1]
    block = block.split("```", 1)[0].replace("\\\n", " ")
    return [line for line in block.splitlines() if line.startswith("curl ")]


def test_the_guides_curl_lines_answer_as_shown(served):
    """The guide's requests, run as a user pastes them into a shell, answer with the shapes it
    shows: one embedding of the model's width, and three hits with id, score and metadata."""
    import subprocess

    embed, search = guide_curl_lines()
    assert SERVE in embed and SEARCH in search  # the pipeline's own names, as deployed
    answers = [
        json.loads(subprocess.run(line, shell=True, capture_output=True, check=True).stdout)
        for line in (embed, search)
    ]
    vectors, hits = answers
    assert vectors["object"] == "list" and vectors["model"] == "retrieval"
    [row] = vectors["data"]
    assert len(row["embedding"]) == 64 and abs(np.linalg.norm(row["embedding"]) - 1) < 1e-3
    assert hits["model"] == "retrieval-index" and len(hits["results"]) == 1
    [found] = hits["results"]
    assert len(found) == 3 and all({"id", "score", "metadata"} <= set(h) for h in found)
    assert found[0]["score"] >= found[-1]["score"] and "caption" in found[0]["metadata"]


METRICS = "http://127.0.0.1:8080/metrics"  # cluster/start.sh's --metrics-export-port


def exported(text: str, name: str, model: str, le: float | None = None) -> float:
    """The value of `name` for `model` in a Prometheus scrape, summed over its other labels
    (a histogram's bucket: `le` given), 0 when absent."""
    total = 0.0
    for line in text.splitlines():
        series, _, value = line.rpartition(" ")
        if not (series.startswith(name + "{") and f'model="{model}"' in series):
            continue
        bound = re.search(r'le="([^"]+)"', series)
        if le is None or (bound and float(bound.group(1)) == le):
            total += float(value)
    return total


def test_embedding_and_search_requests_and_the_index_version_are_exported(served):
    """What a retrieval dashboard needs, scraped as Prometheus would (cluster/monitoring): each
    replica's requests, their time, inputs or queries per request (three requests of two, in
    the bucket above one: Ray exports a histogram's buckets exactly, its sum approximately),
    and the index version."""
    import time

    items = "ray_raytorch_retrieval_items_per_request"

    def figures() -> dict[str, float]:
        text = requests.get(METRICS, timeout=10).text
        out = {}
        for what, model in (("embed", "retrieval"), ("search", "retrieval-index")):
            out[f"{what} requests"] = exported(text, f"{items}_count", model)
            pairs = exported(text, f"{items}_bucket", model, 2.0)
            out[f"{what} of two"] = pairs - exported(text, f"{items}_bucket", model, 1.0)
            out[f"{what} timed"] = exported(text, "ray_raytorch_retrieval_latency_ms_count", model)
        out["index version"] = exported(text, "ray_raytorch_index_version", "retrieval-index")
        return out

    before = figures()
    for _ in range(3):
        body = {"model": "retrieval", "input": ["a red circle", "a blue square"]}
        assert requests.post(EMBED, json=body, timeout=60).status_code == 200
        queries = {"queries": [{"text": "a red circle"}, {"text": "a blue square"}], "top_k": 2}
        assert requests.post(SEARCH, json=queries, timeout=60).status_code == 200
    deadline = time.monotonic() + 120  # replicas flush each second, Ray exports every few
    while True:
        now = figures()
        grown = {k: now[k] - before[k] for k in now if k != "index version"}
        if min(grown.values()) >= 3 or time.monotonic() > deadline:
            break
        time.sleep(2)
    assert min(grown.values()) >= 3, (grown, now)
    assert now["index version"] >= 1, now


# --- the search page, in a real headless browser ------------------------------------------------

CHROMIUM = "/usr/bin/chromium"  # Debian's package: `make test` installs it (apt, as root)
BROWSER_ARGS = ["--no-sandbox", "--disable-background-networking", "--disable-component-update"]


@pytest.fixture(scope="module")
def page(served):
    """A headless chromium on the search page; a missing browser skips with the command that
    installs it, and fails under CI=true (where `make test` installed it)."""
    if not os.path.exists(CHROMIUM):
        message = f"no {CHROMIUM}: apt-get install -y chromium (or make test, as root)"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=BROWSER_ARGS)
        tab = browser.new_page()
        failures: list[str] = []
        tab.on("pageerror", lambda e: failures.append(str(e)))
        tab.goto(f"{SERVE}/search")
        tab.wait_for_selector("#index option[value='retrieval-index']", state="attached")
        tab.select_option("#index", "retrieval-index")
        yield tab
        browser.close()
    assert not failures, failures  # the page's script never threw


def corpus_of(served) -> list[dict]:
    """The indexed val pictures (the pipeline's corpus): id, PNG bytes and caption."""
    import pyarrow.parquet as pq

    [path] = served["root"].glob("runs/*-index/corpus/pictures.parquet")
    return pq.read_table(path).to_pylist()


def page_hits(page, submit) -> list[str]:
    """The ids the page shows after `submit()` (a click, a drop)."""
    page.evaluate("document.getElementById('results').replaceChildren()")
    submit()
    page.wait_for_selector("#results li .id, #error:not([hidden])")
    return [e.text_content() for e in page.query_selector_all("#results li .id")]


def test_the_search_page_finds_a_val_picture_by_its_caption_with_its_thumbnail(served, page):
    """The caption of a val picture that search ranks in its top five, typed into the page:
    the page shows the API's answer in its order, the picture among it with its thumbnail,
    and the index's version and encoder."""
    items = corpus_of(served)
    caption_column = next(k for k in items[0] if k not in ("id", "image"))
    for item in items:
        body = {"query": {"text": item[caption_column]}, "top_k": 5}
        api = [h["id"] for h in requests.post(SEARCH, json=body, timeout=30).json()["results"][0]]
        if item["id"] in api:
            break
    else:
        pytest.fail("search ranks no val picture's caption within its top five")
    page.fill("#caption", item[caption_column])
    page.fill("#top_k", "5")
    shown = page_hits(page, lambda: page.click("button[type=submit]"))
    assert shown == api
    status = page.text_content("#status")
    assert "retrieval-index version" in status and "encoder retrieval version" in status
    own_id = page.locator(".id", has_text=re.compile(f"^{re.escape(item['id'])}$"))
    card = page.locator("#results li", has=own_id)
    card.locator("img:not([hidden])").wait_for()
    width = card.locator("img").evaluate("img => img.naturalWidth")
    assert 0 < width <= 128  # the stored JPEG, fetched by id as a blob
    if shot := os.environ.get("SEARCH_PAGE_SCREENSHOT"):  # docs/search-page.png
        page.screenshot(path=shot, full_page=True)


def test_a_picture_dropped_on_the_page_finds_itself_first(served, page):
    """A val picture's file dropped on the page: the picture itself at the top score (a
    generated twin, the same pixels, may share it)."""
    item = corpus_of(served)[3]
    data = base64.b64encode(item["image"]).decode()
    drop = page.evaluate_handle(
        """data => {
            const bytes = Uint8Array.from(atob(data), c => c.charCodeAt(0));
            const transfer = new DataTransfer();
            transfer.items.add(new File([bytes], "val.png", {type: "image/png"}));
            return transfer;
        }""",
        data,
    )
    page.fill("#caption", "")
    shown = page_hits(page, lambda: page.dispatch_event("#drop", "drop", {"dataTransfer": drop}))
    scores = [float(e.text_content().split()[1]) for e in page.query_selector_all(".score")]
    assert item["id"] in shown and scores[shown.index(item["id"])] == scores[0]
    assert scores[0] > 0.999


def test_a_refused_search_shows_its_error_and_metadata_stays_text(served, page):
    """A top_k over serve.max_top_k: the page shows the 413's message, not a blank page. The
    notes index's items carry HTML in their metadata: shown as text, never run."""
    page.fill("#caption", "a red circle")
    page.fill("#top_k", "100000")
    assert page_hits(page, lambda: page.click("button[type=submit]")) == []
    assert "413: top_k: 100000 is over serve.max_top_k" in page.text_content("#error")
    page.select_option("#index", "retrieval-notes")
    page.fill("#top_k", "3")
    assert len(page_hits(page, lambda: page.click("button[type=submit]"))) == 3
    assert HTML_NOTE in page.text_content("#results")
    assert page.evaluate("window.injected === undefined")
    assert page.query_selector("#results b") is None and not page.is_visible("#error")
    page.select_option("#index", "retrieval-index")


# --- search, the OpenAI client, the listing, and a new index version under load -----------------


def test_search_answers_texts_stored_ids_and_filters(served):
    summary = served["summary"]
    caption = summary["sample_request"]["caption"]
    r = requests.post(SEARCH, json={"queries": [{"text": caption}], "top_k": 3}, timeout=30)
    assert r.status_code == 200, r.text
    [hits] = r.json()["results"]
    assert len(hits) == 3 and hits[0]["score"] >= hits[-1]["score"]
    stored = hits[0]["id"]
    again = requests.post(SEARCH, json={"query": {"id": stored}, "top_k": 1}, timeout=30).json()
    assert again["results"][0][0]["id"] == stored
    kept = hits[1]["metadata"]["caption"]
    body = {"query": {"text": caption}, "top_k": 5, "filter": {"caption": kept}}
    filtered = requests.post(SEARCH, json=body, timeout=30).json()["results"][0]
    assert filtered and {h["metadata"]["caption"] for h in filtered} == {kept}
    assert r.json()["encoder_version"] == summary["stages"]["deploy"]["version"]


def test_a_search_takes_one_hop_and_reads_base64_embeddings(served, cluster):
    """The index's own application holds the `:search` path (Serve's proxy hands it straight to
    the index's replicas), and a base64 float32 embedding finds what its floats find."""
    headers = {"Authorization": f"Bearer {cluster['token']}"}
    apps = requests.get(f"{DASHBOARD}/api/serve/applications/", headers=headers, timeout=10)
    prefixes = {a["route_prefix"] for a in apps.json()["applications"].values()}
    assert "/v1/models/retrieval-index:search" in prefixes
    floats = requests.post(EMBED, json={"model": "retrieval", "input": "a red circle"}, timeout=30)
    vector = np.asarray(floats.json()["data"][0]["embedding"], np.float32)
    as_floats = {"query": {"embedding": vector.tolist()}, "top_k": 5}
    packed = base64.b64encode(vector.astype("<f4").tobytes()).decode()
    as_base64 = {"query": {"embedding": packed}, "top_k": 5, "encoding_format": "base64"}
    answers = [requests.post(SEARCH, json=b, timeout=30) for b in (as_floats, as_base64)]
    assert [a.status_code for a in answers] == [200, 200], answers[1].text
    hits = [[h["id"] for h in a.json()["results"][0]] for a in answers]
    assert hits[0] == hits[1] and len(hits[0]) == 5


def test_the_openai_client_reads_the_embeddings_the_route_answers(served):
    """OpenAI's own client asks for base64 floats by default: the same vector as JSON floats."""
    from openai import OpenAI

    floats = requests.post(EMBED, json={"model": "retrieval", "input": "a red circle"}, timeout=30)
    client = OpenAI(base_url=f"{SERVE}/v1", api_key="unused")
    answer = client.embeddings.create(model="retrieval", input="a red circle")
    expected = np.asarray(floats.json()["data"][0]["embedding"])
    assert np.abs(np.asarray(answer.data[0].embedding) - expected).max() < 1e-6


def test_the_pipeline_lists_its_index_with_its_encoder(served):
    summary = served["summary"]
    index = summary["stages"]["index"]
    assert index["name"] == "retrieval-index" and index["report"]["vectors"] > 0
    assert summary["sample_request"]["hits"]
    listing = requests.get(f"{SERVE}/v1/models", timeout=10).json()["models"]
    [listed] = [m for m in listing if m["name"] == "retrieval-index"]
    encoder = listed["manifest"]["encoder"]
    assert encoder["name"] == "retrieval"
    assert encoder["version"] == summary["stages"]["export"]["artifact"].rsplit("/", 1)[-1]


class SearchLoad(ClosedLoop):
    """Closed-loop search from `threads` connections: status codes and answering versions."""

    def __init__(self, threads: int):
        from collections import Counter

        self.codes: Counter = Counter()
        self.answers: list[tuple[float, str]] = []
        super().__init__(threads)

    def _run(self) -> None:
        with requests.Session() as session:
            while not self._stop.is_set():
                try:
                    r = session.post(SEARCH, json={"query": {"text": "a red circle"}}, timeout=30)
                    self.codes[r.status_code] += 1
                    if r.status_code == 200:
                        self.answers.append((time.monotonic(), r.json()["version"]))
                except requests.RequestException as e:
                    self.codes[type(e).__name__] += 1


def test_a_new_index_version_replaces_the_old_under_load_without_a_failed_answer(served):
    """Last in this module: the index it deploys is the same items, one version on."""
    from collections import Counter

    stages, config = served["summary"]["stages"], served["config"]
    old = stages["index"]["artifact"].rsplit("/", 1)[-1]
    built = run_job("index", *config, f"--embeddings={stages['predict']['output']}")
    new = built["artifact"].rsplit("/", 1)[-1]
    assert new != old
    with SearchLoad(threads=8) as load:
        time.sleep(1)
        deployed = run_job("deploy", *config, f"--artifact={built['artifact']}")
        done_at = time.monotonic()
        time.sleep(2)
    assert deployed["version"] == new
    assert set(load.codes) == {200}, load.codes
    versions = Counter(v for _, v in load.answers)
    assert set(versions) <= {old, new} and versions[new] > 0, versions
    assert {v for t, v in load.answers if t > done_at} == {new}
