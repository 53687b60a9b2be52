"""A Llama-style decoder through every stage, as the README shows it with a real folder:
`python -m jobs.pipeline --config configs/gpt2-finetune.yaml model.pretrained=<folder>`, here a
tiny random Qwen2 folder (tools/make_tiny_pretrained.py) on a small corpus, on the suite's
cluster. Trained at a negligible learning rate and served in fp32, the deployed model's
temperature-0 completion is transformers' greedy continuation of the same folder."""

from __future__ import annotations

import pytest
import requests

from tests.conftest import REPO
from tests.e2e.conftest import API_KEY_HEADER, PY, SERVE, run_command, undeploy
from tools.make_tiny_pretrained import make_decoder

pytestmark = pytest.mark.e2e
MODEL = "qwen-tiny"
PROMPT, TOKENS = "def parse(", 12


@pytest.fixture(scope="module")
def pipeline(cluster, tmp_path_factory):
    root = tmp_path_factory.mktemp("decoder")
    folder = make_decoder(str(root / "qwen2"), "qwen2")
    summary = run_command(
        [
            PY,
            "-m",
            "jobs.pipeline",
            "--config",
            "configs/gpt2-finetune.yaml",
            f"model.pretrained={folder}",
            "data.path={stdlib}/email/*.py",
            "data.val_fraction=0.2",
            f"data.output={root}/data",
            f"train.storage_path={root}/runs",
            f"export.registry={root}/registry",
            f"export.name={MODEL}",
            "model.max_length=64",
            "train.num_workers=1",
            "train.max_steps=2",
            "train.lr=1e-12",
            "serve.variant=fp32",
            "serve.autoscaling.max_replicas=1",
        ],
        REPO,
        timeout=900,
    )
    yield folder, summary
    undeploy([MODEL])  # its replica's CPU share goes back to the other modules' tests


def test_the_pipeline_ends_with_a_completion_over_http(pipeline):
    _, summary = pipeline
    assert summary["url"] == SERVE
    assert summary["stages"]["export"]["report"]["task"] == "lm"
    assert summary["sample_request"]["completion"]  # the smoke request streamed some text


def test_a_greedy_completion_is_transformers_greedy_continuation_of_the_folder(pipeline):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, _ = pipeline
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0}
    answer = requests.post(f"{SERVE}/v1/completions", json=body, headers=API_KEY_HEADER, timeout=60)
    assert answer.status_code == 200, answer.text
    served = answer.json()["choices"][0]["text"]
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=TOKENS, do_sample=False)
    expected = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    assert served == expected
