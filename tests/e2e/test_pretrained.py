"""Pretrained folders through the whole pipeline on the live cluster, one run per family:
the README's `jobs.pipeline` command for each (tests/readme_commands.py) prepares, fine-tunes,
evaluates, exports (int8 gate) and deploys a generated tiny GPT-2, BERT and ViT folder, and the
endpoint answers. The classifiers train their new head only
(`train.freeze=backbone`), so the served answer must be exactly what transformers computes from
the folder's weights and the trained head."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
import requests
import torch
from safetensors.torch import load_file

from tests.conftest import REPO
from tests.e2e.conftest import SERVE, collect_jobs, live_models, start_jobs, undeploy
from tests.readme_commands import PRETRAINED, fill
from tools.make_tiny_pretrained import MAKERS

# The README's per-family pipelines run in `make test-all`; `make test` runs the digits chain
# (tests/readme_commands.py), and each family's loading and parity with transformers (tests/unit).
pytestmark = [pytest.mark.e2e, pytest.mark.slow]
CONFIGS = {
    "gpt2": "gpt2-finetune",
    "qwen2": "gpt2-finetune",
    "bert": "bert-text",
    "vit": "vit-images",
    "chat": "chat-sft",
}
FOLDERS = {"chat": "qwen2"}  # the tiny folder a family's run starts from (default: its own)
CORPUS = ["data.path={stdlib}/email/*.py", "data.val_fraction=0.2", "model.max_length=64"]
DATA = {  # small data: each run is seconds of training
    "gpt2": CORPUS,
    "qwen2": [*CORPUS, "train.lora_rank=4"],  # LoRA on the decoder's projections, merged
    "bert": ["data.num_rows=400", "train.freeze=backbone", "train.lr=0.01"],
    "vit": ["data.num_rows=400", "train.freeze=backbone", "train.lr=0.01"],
    "chat": [f"data.path={REPO}/examples/chat/word_rules.jsonl", "model.max_length=128"],
}


@pytest.fixture(scope="module")
def pipelines(cluster, tmp_path_factory, request):
    """The four pipelines run at once (as four users would submit them), while the README's
    digits chain runs too: each spends most of its time starting processes and waiting on Ray,
    so together they take little more than one. Small CPU shares let all of them train and
    serve beside the models already deployed; they are undeployed when the module ends."""
    root = tmp_path_factory.mktemp("pretrained")
    runs = {}
    for family, config in CONFIGS.items():
        folder = MAKERS[FOLDERS.get(family, family)](str(root / "folders" / family))
        readme = fill(PRETRAINED[family], {})  # the README's command, then this run's budget
        assert readme[3:5] == ["--config", f"configs/{config}.yaml"]
        base = [
            *readme[3:],
            f"model.pretrained={folder}",
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
            *DATA[family],
        ]
        runs[family] = {"base": base, "folder": folder}
    jobs = {family: ("pipeline", run["base"]) for family, run in runs.items()}
    started = start_jobs(jobs)
    request.getfixturevalue("readme_chain")  # the session's chain, on the cluster meanwhile
    summaries = collect_jobs(jobs, started)
    for family, summary in summaries.items():
        runs[family]["summary"] = summary
    yield runs
    undeploy([name for name in live_models() if name.startswith("pt-")])


def served_probabilities(model: str, tensor: dict) -> np.ndarray:
    r = requests.post(f"{SERVE}/v2/models/{model}/infer", json={"inputs": [tensor]}, timeout=60)
    assert r.status_code == 200, r.text
    outputs = {o["name"]: o for o in r.json()["outputs"]}
    probs = outputs["probabilities"]
    return np.asarray(probs["data"], np.float32).reshape(probs["shape"])


def trained_head(summary: dict) -> tuple[torch.Tensor, torch.Tensor, dict]:
    checkpoint = summary["stages"]["train"]["checkpoint"]
    state = load_file(f"{checkpoint}/model.safetensors")
    return state["head.weight"], state["head.bias"], state


def backbone_unchanged(state: dict, folder: str, rename) -> None:
    base = rename(load_file(f"{folder}/model.safetensors"))
    assert set(base) <= set(state)
    for name, tensor in base.items():
        assert torch.equal(state[name], tensor), f"{name} moved under train.freeze=backbone"


def test_gpt2_folder_is_fine_tuned_and_streams_completions(pipelines):
    run = pipelines["gpt2"]
    summary = run["summary"]
    history = summary["stages"]["train"]["history"]
    assert history[-1]["step"] == 12
    sample = summary["sample_request"]
    assert sample["completion"] and sample["first_token_seconds"] is not None
    r = requests.post(
        f"{SERVE}/v1/completions",
        json={"model": "pt-gpt2", "prompt": "import os\n", "max_tokens": 8, "temperature": 0},
        timeout=60,
    )
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] > 0, r.text
    # Chat messages go through the folder's own chat template, rendered as transformers does.
    from transformers import AutoTokenizer

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    chat = requests.post(
        f"{SERVE}/v1/chat/completions",
        json={"model": "pt-gpt2", "messages": messages, "max_tokens": 4, "temperature": 0},
        timeout=60,
    )
    assert chat.status_code == 200, chat.text
    tokenizer = AutoTokenizer.from_pretrained(run["folder"])
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert prompt.startswith("### SYSTEM\nBe brief.")  # the folder's template, not the plain one
    expected = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    assert chat.json()["usage"]["prompt_tokens"] == len(expected)
    models = {m["name"]: m for m in requests.get(f"{SERVE}/v1/models", timeout=10).json()["models"]}
    lineage = models["pt-gpt2"]["manifest"]["base_model"]
    assert lineage["uri"] == run["folder"] and lineage["model_type"] == "gpt2"
    assert len(lineage["weights_sha256"]) == 64


def test_a_qwen2_folder_is_fine_tuned_with_lora_and_chats_in_its_own_template(pipelines):
    """The README's Llama-style command (a tiny random Qwen2 folder: grouped-query attention, a
    tied head, ChatML, two end ids): LoRA adapters merged at export; chat messages rendered by
    the folder's template as transformers renders them, a completion ends at an end id or its
    length."""
    from transformers import AutoTokenizer

    run = pipelines["qwen2"]
    report = run["summary"]["stages"]["export"]["report"]
    assert report["task"] == "lm" and report["greedy"]["token_agreement"] >= 0.9
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    chat = requests.post(
        f"{SERVE}/v1/chat/completions",
        json={"model": "pt-qwen2", "messages": messages, "max_tokens": 6, "temperature": 0},
        timeout=60,
    )
    assert chat.status_code == 200, chat.text
    assert chat.json()["choices"][0]["finish_reason"] in ("stop", "length")
    tokenizer = AutoTokenizer.from_pretrained(run["folder"])
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert prompt.startswith("<|im_start|>system\nBe brief.<|im_end|>")
    expected = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    assert chat.json()["usage"]["prompt_tokens"] == len(expected)


def test_the_readme_chat_fine_tune_of_a_qwen2_folder_answers_on_the_chat_route(pipelines):
    """configs/chat-sft.yaml on a tiny random Qwen2 folder and the example conversations: the
    pipeline's sample request is a chat, the gate passes, an answer ends at the turn's end or
    its length."""
    run = pipelines["chat"]
    summary = run["summary"]
    assert summary["stages"]["prepare"]["rows"]["train"] > 0
    assert summary["sample_request"]["endpoint"].endswith("/v1/chat/completions")
    assert summary["stages"]["export"]["report"]["greedy"]["token_agreement"] >= 0.9
    messages = [{"role": "user", "content": "Which word is a tool: cat saw red bread?"}]
    chat = requests.post(
        f"{SERVE}/v1/chat/completions",
        json={"model": "pt-chat", "messages": messages, "max_tokens": 6, "temperature": 0},
        timeout=60,
    )
    assert chat.status_code == 200, chat.text
    assert chat.json()["choices"][0]["finish_reason"] in ("stop", "length")


def test_bert_folder_with_a_trained_head_answers_as_transformers_computes(pipelines):
    import transformers as hf

    from app.models.bert import rename

    run = pipelines["bert"]
    weight, bias, state = trained_head(run["summary"])
    backbone_unchanged(state, run["folder"], rename)
    texts = ["w12 topic0_3 w80 without topic1_2", "topic2_5 w3 w9"]
    probs = served_probabilities(
        "pt-bert", {"name": "text", "datatype": "BYTES", "shape": [2], "data": texts}
    )
    tokenizer = hf.AutoTokenizer.from_pretrained(run["folder"])
    encoder = hf.BertModel.from_pretrained(run["folder"]).eval()
    inputs = tokenizer(texts, truncation=True, max_length=64, padding=True, return_tensors="pt")
    inputs.pop("token_type_ids", None)
    with torch.no_grad():
        logits = encoder(**inputs).pooler_output @ weight.T + bias
    assert np.abs(probs - torch.softmax(logits, -1).numpy()).max() < 1e-3

    # A text near the 4 MiB body limit is cut to what max_length tokens can span before it is
    # tokenized: answered at once, as its first 64 tokens are.
    huge = texts[0] + " w3" * 1_300_000
    start = time.perf_counter()
    got = served_probabilities(
        "pt-bert", {"name": "text", "datatype": "BYTES", "shape": [1], "data": [huge]}
    )
    assert time.perf_counter() - start < 1.0  # a loose bound (tokenizing it whole takes seconds)
    short = " ".join(huge.split()[:80])
    want = served_probabilities(
        "pt-bert", {"name": "text", "datatype": "BYTES", "shape": [1], "data": [short]}
    )
    assert np.abs(got - want).max() < 1e-6


def test_vit_folder_with_a_trained_head_answers_as_transformers_computes(pipelines):
    import transformers as hf

    from app.models.vit import rename

    run = pipelines["vit"]
    weight, bias, state = trained_head(run["summary"])
    backbone_unchanged(state, run["folder"], rename)
    images = np.random.default_rng(0).integers(0, 256, (2, 32, 32), np.uint8)  # grey, as trained
    tensor = {
        "name": "image",
        "datatype": "FP32",
        "shape": [2, 32 * 32],
        "data": images.reshape(2, -1).astype(float).tolist(),
    }
    probs = served_probabilities("pt-vit", tensor)
    processor = hf.ViTImageProcessor.from_pretrained(run["folder"])
    pixels = processor([np.repeat(i[..., None], 3, -1) for i in images], return_tensors="pt")[
        "pixel_values"
    ]
    encoder = hf.ViTModel.from_pretrained(run["folder"]).eval()
    with torch.no_grad():
        logits = encoder(pixel_values=pixels).pooler_output @ weight.T + bias
    assert np.abs(probs - torch.softmax(logits, -1).numpy()).max() < 1e-3
    listing = json.loads(requests.get(f"{SERVE}/v1/models", timeout=10).text)["models"]
    [vit] = [m for m in listing if m["name"] == "pt-vit"]
    assert vit["manifest"]["base_model"]["model_type"] == "vit"
