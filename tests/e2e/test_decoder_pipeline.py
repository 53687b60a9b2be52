"""A chat fine-tune of a Llama-style decoder through every stage, as the README shows it
(tests/readme_commands.py `SHIPPED`): `python -m jobs.pipeline --config configs/chat-sft.yaml`
as shipped (examples/chat: a tiny
random-weight Qwen2 folder and conversations whose answers follow a rule over words drawn per
row), on the suite's cluster. Through /v1/chat/completions and the openai client the fine-tuned
model answers held-out questions right where the untrained folder does not; served in fp32 it
answers as transformers does with the fine-tuned weights written back into the folder's layout."""

from __future__ import annotations

import json
import random

import pytest

from tests.conftest import REPO
from tests.e2e.conftest import PY, SERVE, TEST_API_KEY, run_command, undeploy
from tests.readme_commands import SHIPPED, fill
from tools.make_chat_example import answer, drawn, question

pytestmark = pytest.mark.e2e
MODEL = "chat-tiny"
FOLDER = REPO / "examples" / "chat" / "tiny-qwen2"
HELD_OUT = 60


@pytest.fixture(scope="module")
def pipeline(cluster, tmp_path_factory):
    root = tmp_path_factory.mktemp("chat")
    paths = [
        f"data.output={root}/data",
        f"train.storage_path={root}/runs",
        f"export.registry={root}/registry",
        f"export.name={MODEL}",
        "serve.autoscaling.max_replicas=1",
    ]
    readme = next(c for c, test in SHIPPED.items() if test.endswith("test_decoder_pipeline.py"))
    summary = run_command([*fill(readme, {}), *paths], REPO, timeout=900)
    yield paths, summary
    undeploy([MODEL])  # its replica's CPU share goes back to the other modules' tests


@pytest.fixture(scope="module")
def held_out() -> list[tuple[str, str]]:
    """Questions no training conversation asks, and their answers."""
    with open(REPO / "examples" / "chat" / "word_rules.jsonl") as f:
        asked = {m["content"] for line in f for m in json.loads(line)["messages"]}
    rng, out = random.Random(2026), []
    while len(out) < HELD_OUT:
        kind, words = drawn(rng)
        if (q := question(kind, words)) not in asked:
            out.append((q, answer(kind, words)))
    return out


def chat(client, text: str) -> tuple[str, str]:
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": text}], max_tokens=8, temperature=0
    )
    return reply.choices[0].message.content, reply.choices[0].finish_reason


def test_the_pipeline_ends_with_a_chat_answer_over_http(pipeline):
    _, summary = pipeline
    assert summary["url"] == SERVE
    sample = summary["sample_request"]
    assert sample["endpoint"].endswith("/v1/chat/completions") and sample["completion"]
    report = summary["stages"]["export"]["report"]
    assert report["task"] == "lm" and report["greedy"]["token_agreement"] >= 0.9


def test_held_out_questions_are_answered_right_after_sft_and_not_before(pipeline, held_out):
    from openai import OpenAI

    client = OpenAI(base_url=f"{SERVE}/v1", api_key=TEST_API_KEY, max_retries=0)
    answers = [chat(client, q) for q, _ in held_out]
    right = sum(got.strip() == want for (got, _), (_, want) in zip(answers, held_out, strict=True))
    assert right >= 0.9 * HELD_OUT, answers
    assert all(reason == "stop" for _, reason in answers)  # it learned to end its turn
    before = sum(
        a.strip() == want for a, (_, want) in zip(untrained(held_out), held_out, strict=True)
    )
    assert before < 0.1 * HELD_OUT


def untrained(held_out: list[tuple[str, str]]) -> list[str]:
    """The folder's own greedy answers (transformers)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(FOLDER)
    model = AutoModelForCausalLM.from_pretrained(FOLDER, dtype=torch.float32).eval()
    return [greedy(model, tokenizer, q) for q, _ in held_out]


def greedy(model, tokenizer, text: str) -> str:
    import torch

    messages = [{"role": "user", "content": text}]
    ids = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=8, do_sample=False)
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


def test_served_fp32_answers_as_transformers_with_the_fine_tuned_weights(pipeline, held_out):
    from openai import OpenAI

    paths, summary = pipeline
    artifact = summary["stages"]["export"]["artifact"]
    deploy = [PY, "-m", "jobs.deploy", "--config", "configs/chat-sft.yaml", *paths]
    run_command([*deploy, "serve.variant=fp32", "--artifact", artifact], REPO, timeout=300)
    client = OpenAI(base_url=f"{SERVE}/v1", api_key=TEST_API_KEY, max_retries=0)
    model, tokenizer = fine_tuned(summary["stages"]["train"]["checkpoint"])
    for text, _ in held_out[:12]:
        assert chat(client, text)[0] == greedy(model, tokenizer, text)


def fine_tuned(checkpoint: str):
    """transformers' model of the folder with the checkpoint's weights under its names."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from app.models.llama import rename
    from app.train.checkpoint import load_checkpoint

    ours = load_checkpoint(checkpoint).model.state_dict()
    model = AutoModelForCausalLM.from_pretrained(FOLDER, dtype=torch.float32).eval()
    names = rename({k: k for k in model.state_dict()}, model.config.to_dict())
    missing, _ = model.load_state_dict({names[k]: v for k, v in ours.items()}, strict=False)
    assert missing == ["lm_head.weight"]  # tied: the embedding loaded is the head
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    return model, AutoTokenizer.from_pretrained(FOLDER)
