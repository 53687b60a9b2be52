"""Retrieval on the live cluster: the README's CLIP and BERT + ViT pipelines
(tests/readme_commands.py:PRETRAINED) on tiny generated folders with the towers frozen
(`train.freeze=towers`, as LiT trains), so the served embeddings must be transformers' towers
behind the trained projections; hostile inputs get a 4xx naming what is wrong and leave the
replica serving. Marked slow (make test-all): two pretrained pipelines beside the suite's
deployments are more than make test's budget allows. Search, filters, the OpenAI client, the
listing and a new index version under load run in make test on the from-scratch pipeline
(tests/e2e/test_retrieval_serve.py)."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
import requests

from tests.e2e.conftest import SERVE, live_models, run_jobs, undeploy
from tests.readme_commands import PRETRAINED, fill
from tools.make_tiny_pretrained import MAKERS

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
RETRIEVAL = [
    "data.num_rows=160",
    "data.image_size=32",
    "train.freeze=towers",
    "train.lr=0.01",
    "train.batch_size=16",
    "predict.actor_cpus=0.25",  # the val pictures embedded for the index, beside the rest
    "predict.max_actors=1",
]


def folders(family: str, root) -> tuple[str, list[str]]:
    """A tiny folder (two for the dual encoder: BERT text, ViT image) and the overrides that
    point the config at it."""
    if family == "dual":
        text = MAKERS["bert"](str(root / "folders" / "dual-text"))
        image = MAKERS["vit"](str(root / "folders" / "dual-image"))
        return text, [f"model.pretrained_text={text}", f"model.pretrained_image={image}"]
    folder = MAKERS[family](str(root / "folders" / family))
    return folder, [f"model.pretrained={folder}"]


@pytest.fixture(scope="module")
def pipelines(cluster, tmp_path_factory):
    root = tmp_path_factory.mktemp("retrieval")
    runs = {}
    for family in ("clip", "dual"):
        folder, pointed = folders(family, root)
        base = [
            *fill(PRETRAINED[family], {})[3:],
            *pointed,
            f"data.output={root}/data/{family}",
            f"train.storage_path={root}/runs",
            f"export.registry={root}/registry",
            f"export.name=pt-{family}",
            "train.num_workers=1",
            "train.max_steps=12",
            "serve.variant=fp32",
            "serve.autoscaling.max_replicas=1",
            "train.cpus_per_worker=0.25",
            "serve.replica_cpus=0.25",
            *RETRIEVAL,
            *(["model.embed_dim=16"] if family == "dual" else []),
        ]
        runs[family] = {"base": base, "folder": folder}
    summaries = run_jobs({family: ("pipeline", run["base"]) for family, run in runs.items()})
    for family, summary in summaries.items():
        runs[family]["summary"] = summary
    yield runs
    undeploy([name for name in live_models() if name.startswith("pt-")])


SEARCH = f"{SERVE}/v1/models/pt-clip-index:search"
EMBED = f"{SERVE}/v1/embeddings"


def png(width: int, height: int, mode: str = "RGB") -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new(mode, (width, height)).save(buffer, format="PNG")
    return buffer.getvalue()


def picture(data: bytes) -> dict:
    url = "data:image/png;base64," + base64.b64encode(data).decode()
    return {"type": "image_url", "image_url": {"url": url}}


REMOTE = {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}
HOSTILE = [
    ("remote image URL", EMBED, {"input": ["a cat", REMOTE]}, 400, "input[1]"),
    (
        "corrupt picture",
        EMBED,
        {"input": [picture(b"\x89PNG\r\n\x1a\nnot really")]},
        400,
        "input[0]",
    ),
    (
        "decompression bomb",
        EMBED,
        {"input": ["ok", picture(png(9000, 8000, "L"))]},
        413,
        "input[1]",
    ),
    ("empty string", EMBED, {"input": ["fine", ""]}, 400, "input[1]"),
    ("dimensions", EMBED, {"input": "a cat", "dimensions": 8}, 400, "dimensions"),
    ("token ids", EMBED, {"input": [[1, 2, 3]]}, 400, "input[0]"),
    ("top_k over the limit", SEARCH, {"query": {"text": "a"}, "top_k": 10**6}, 413, "top_k"),
    ("wrong dimension", SEARCH, {"query": {"embedding": [0.1] * 3}}, 400, "embedding"),
    ("unknown filter field", SEARCH, {"query": {"text": "a"}, "filter": {"nope": 1}}, 400, "nope"),
    ("unknown stored id", SEARCH, {"query": {"id": "no-such-item"}}, 404, "queries[0].id"),
    ("remote search picture", SEARCH, {"query": {"image": "http://x/y.png"}}, 400, "image"),
]


@pytest.mark.parametrize(
    "url, body, status, named", [h[1:] for h in HOSTILE], ids=[h[0] for h in HOSTILE]
)
def test_hostile_inputs_get_a_4xx_naming_them_and_the_replicas_keep_serving(
    pipelines, url, body, status, named
):
    if url == EMBED:
        body = {"model": "pt-clip", **body}
    before = requests.post(EMBED, json={"model": "pt-clip", "input": "a cat"}, timeout=30)
    r = requests.post(url, json=body, timeout=60)
    assert r.status_code == status, r.text
    assert named in r.text, r.text
    after = requests.post(EMBED, json={"model": "pt-clip", "input": "a cat"}, timeout=30)
    assert after.status_code == 200
    assert after.headers.get("x-model-replica") == before.headers.get("x-model-replica")


def trained_state(summary: dict) -> dict:
    from safetensors.torch import load_file

    return load_file(f"{summary['stages']['train']['checkpoint']}/model.safetensors")


def served_embeddings(model: str, items: list) -> np.ndarray:
    r = requests.post(EMBED, json={"model": model, "input": items}, timeout=60)
    assert r.status_code == 200, r.text
    return np.asarray([d["embedding"] for d in r.json()["data"]], np.float32)


def unit(x) -> np.ndarray:
    """L2-normalised rows (transformers' get_*_features answers a tensor, or in newer releases
    an output whose pooler_output is the projected embedding)."""
    import torch

    return torch.nn.functional.normalize(getattr(x, "pooler_output", x), dim=-1).numpy()


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


def encoded(pictures: np.ndarray) -> list[dict]:
    from PIL import Image

    out = []
    for p in pictures:
        buffer = io.BytesIO()
        Image.fromarray(p).save(buffer, format="PNG")
        out.append(picture(buffer.getvalue()))
    return out


PICTURES = np.random.default_rng(1).integers(0, 256, (2, 40, 56, 3), np.uint8)  # not square
CAPTIONS = ["a small red circle at the top left", "two blue squares"]


def test_clip_folder_served_embeddings_equal_transformers_from_raw_bytes(pipelines):
    import torch
    import transformers as hf

    run = pipelines["clip"]
    state = trained_state(run["summary"])
    model = hf.CLIPModel.from_pretrained(run["folder"]).eval()
    with torch.no_grad():
        model.visual_projection.weight.copy_(state["image_proj.weight"])
        model.text_projection.weight.copy_(state["text_proj.weight"])
    tokenizer = hf.PreTrainedTokenizerFast(
        tokenizer_file=f"{run['folder']}/tokenizer.json", pad_token="<|endoftext|>"
    )
    tokens = tokenizer(
        CAPTIONS, return_tensors="pt", padding="max_length", max_length=32, truncation=True
    )
    pixels = hf.CLIPImageProcessor.from_pretrained(run["folder"])(
        list(PICTURES), return_tensors="pt"
    )["pixel_values"]
    with torch.no_grad():
        images = unit(model.get_image_features(pixel_values=pixels))
        texts = unit(model.get_text_features(**tokens))
    served = served_embeddings("pt-clip", [*CAPTIONS, *encoded(PICTURES)])
    assert cosines(served, np.concatenate([texts, images])).min() >= 0.999
    from openai import OpenAI  # as a user calls it: base64 floats by default

    client = OpenAI(base_url=f"{SERVE}/v1", api_key="unused")
    answer = client.embeddings.create(model="pt-clip", input=CAPTIONS[0])
    assert np.abs(np.asarray(answer.data[0].embedding) - served[0]).max() < 1e-6


def test_bert_and_vit_dual_encoder_served_embeddings_equal_transformers(pipelines):
    import torch
    import transformers as hf

    run = pipelines["dual"]
    state = trained_state(run["summary"])
    text_folder = run["folder"]
    image_folder = text_folder.replace("dual-text", "dual-image")
    tokenizer = hf.AutoTokenizer.from_pretrained(text_folder)
    tokens = tokenizer(
        CAPTIONS, truncation=True, max_length=32, padding="max_length", return_tensors="pt"
    )
    tokens.pop("token_type_ids", None)
    pixels = hf.ViTImageProcessor.from_pretrained(image_folder)(
        list(PICTURES), return_tensors="pt"
    )["pixel_values"]
    with torch.no_grad():
        text = hf.BertModel.from_pretrained(text_folder).eval()(**tokens).pooler_output
        image = hf.ViTModel.from_pretrained(image_folder).eval()(pixel_values=pixels).pooler_output
        texts = unit(text @ state["text_proj.weight"].T)
        images = unit(image @ state["image_proj.weight"].T)
    served = served_embeddings("pt-dual", [*CAPTIONS, *encoded(PICTURES)])
    assert cosines(served, np.concatenate([texts, images])).min() >= 0.999
