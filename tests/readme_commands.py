"""The README's commands, as a user copies them: every `python -m jobs.*` and `ray job submit`
line of its code blocks, and which test runs each.

- `CHAIN`: the digits chain, run in order by the e2e tier in `make test`
  (tests/e2e/conftest.py:readme_chain), on the suite's cluster.
- `PRETRAINED`: the pipelines on downloaded folders, run in `make test-all` by
  tests/e2e/test_pretrained.py (marked slow) with `model.pretrained=` a tiny folder
  (tools/make_tiny_pretrained.py) and small data.
- `LATER`: run by `make test-all` (tests/e2e/test_readme_commands.py, marked slow), each with
  the overrides it maps to.
- `SEEDED`: run by `make test-all` once per seed (`train.seed=S`), its summary checked.
- `SHIPPED`: run as shown (only where its outputs go changed) by the e2e tier in `make test`,
  by the test named beside it.
- `SKIPPED`: not run, with the reason.

A README command in none of them fails tests/unit/test_readme_commands.py, and so does an
entry here that the README no longer has. Placeholders are filled by `fill` from the summaries
of the commands before (URI, ARTIFACT_URI, NAME, N); optional `[...]` parts are dropped; a step
or epoch budget may be appended.
"""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"

CHAIN = [
    "python -m jobs.prepare --config configs/digits.yaml [section.key=value ...]",
    "python -m jobs.train --config configs/digits.yaml [overrides]",
    "python -m jobs.evaluate --config configs/digits.yaml --checkpoint URI",
    "python -m jobs.export --config configs/digits.yaml --checkpoint URI",
    "python -m jobs.export --verify ARTIFACT_URI",
    "python -m jobs.predict --artifact ARTIFACT_URI --input URI --output URI [--id-column id]"
    " [--overwrite] [--config C] [overrides]",
    "python -m jobs.tune --config configs/digits.yaml",
    "python -m jobs.deploy --config configs/digits.yaml --artifact ARTIFACT_URI",
    "python -m jobs.models list",
]
# What `make test` appends to a chain command (by stage): budgets that keep the suite short.
BUDGETS = {
    "train": ["train.epochs=4"],
    "tune": ["tune.num_trials=2", "tune.grace_period=1", "train.epochs=1", "train.num_workers=1"],
}
PRETRAINED = {
    "qwen2": "python -m jobs.pipeline --config configs/gpt2-finetune.yaml"
    " model.pretrained=models/qwen2.5-0.5b-instruct",
    "gpt2": "python -m jobs.pipeline --config configs/gpt2-finetune.yaml",
    "bert": "python -m jobs.pipeline --config configs/bert-text.yaml"
    " model.pretrained=models/bert-base-uncased",
    "vit": "python -m jobs.pipeline --config configs/vit-images.yaml",
    "chat": "python -m jobs.pipeline --config configs/chat-sft.yaml"
    " model.pretrained=models/qwen2.5-0.5b-instruct data.path=my_chats.jsonl train.lr=2e-5",
    "clip": "python -m jobs.pipeline --config configs/clip-finetune.yaml",
    "dual": "python -m jobs.pipeline --config configs/dual-encoder.yaml",
}
LATER = {
    "python -m jobs.models undeploy NAME [NAME ...]": [],
    "python -m jobs.models prune --keep N [--model NAME] [--force]": [],
    "python -m jobs.pipeline --config configs/digits.yaml": ["train.epochs=4"],
    "python -m jobs.pipeline --config configs/tabular.yaml 'export.formats=[onnx,aoti,executorch]'"
    " serve.variant=auto": [],
    "ray job submit --address http://127.0.0.1:8265 --runtime-env cluster/runtime_env.yaml"
    " --working-dir . -- python -m jobs.pipeline --config configs/text.yaml": ["train.epochs=3"],
}
# Run once per seed by `make test-all` (tests/e2e/test_readme_commands.py, slow): the bar of
# configs/retrieval.yaml (R@5 >= 50 both ways) must hold for each, not for a lucky one.
SEEDED = {"python -m jobs.pipeline --config configs/retrieval.yaml": (0, 1, 2)}
SHIPPED = {
    "python -m jobs.pipeline --config configs/chat-sft.yaml": "tests/e2e/test_decoder_pipeline.py"
}
SKIPPED: dict[str, str] = {}

COMMAND = re.compile(r"^(python -m jobs\.|ray job submit)")


def readme_commands(text: str | None = None) -> list[str]:
    """The commands of the README's code blocks, continuation lines joined, comments and
    repeated spaces dropped."""
    text = README.read_text() if text is None else text
    out = []
    for block in re.findall(r"```[a-z]*\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = " ".join(line.split("#", 1)[0].split())
            if COMMAND.match(line):
                out.append(line)
    return out


def fill(command: str, state: dict[str, Any]) -> list[str]:
    """The argv that runs `command`: optional parts dropped, placeholders from `state`
    (summaries by stage, and `input`, `output`), `python` this interpreter, the budget of its
    stage appended."""
    command = re.sub(r"\s+\[[^\]]*\]", "", command)  # a word's own `=[a,b]` is kept
    argv = shlex.split(command)
    stage = argv[2].removeprefix("jobs.") if argv[:2] == ["python", "-m"] else "submit"
    out = []
    for i, word in enumerate(argv):
        flag = argv[i - 1] if i else ""
        out.append(_value(word, flag, state))
    if out[0] == "python":
        out[0] = sys.executable
    return out + BUDGETS.get(stage, [])


def _value(word: str, flag: str, state: dict[str, Any]) -> str:
    if word == "ARTIFACT_URI":
        return state["export"]["artifact"]
    if word == "URI":
        return {
            "--checkpoint": lambda: state["train"]["checkpoint"],
            "--input": lambda: state["input"],
            "--output": lambda: state["output"],
        }[flag]()
    if word == "NAME":
        return state["export"]["artifact"].rstrip("/").split("/")[-2]
    if word == "N":
        return "1"
    return word
