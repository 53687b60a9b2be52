"""The pretrained families: one per `model_type` a Hugging Face folder may name. Each is the
kind of data it trains on, the plain `torch.nn` module built from the folder's config (its
architecture, random weights), the renaming of the folder's tensors to that module's, and the
files that carry its preprocessing. A new family is a module and an entry here.

Reading and checking the folder itself is app/pretrained.py (I/O, no torch); this module says
what a folder's model is.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

from app.config import ConfigError, ModelConfig
from app.data.kinds.image import Image
from app.data.kinds.text import Text
from app.data.kinds.tokens import Tokens
from app.data.preprocess import Preprocessor
from app.models import bert, gpt, vit
from app.pretrained import IMAGE_PROCESSOR, TOKENIZER, VOCAB, Pretrained, open_pretrained

Build = Callable[[dict[str, Any], Any, ModelConfig], nn.Module]
Rename = Callable[[dict[str, Any]], dict[str, Any]]


@dataclass(frozen=True)
class Family:
    model_type: str
    takes: type[Preprocessor]  # the kind of data it trains on
    build: Build  # (architecture, preprocessor, model config) -> module, random weights
    rename: Rename  # the folder's tensors -> the module's state dict
    preprocessing: tuple[str, ...]  # the files, any one of which carries its preprocessing


FAMILIES: dict[str, Family] = {
    f.model_type: f
    for f in (
        Family("gpt2", Tokens, gpt.from_gpt2, gpt.rename_gpt2, (TOKENIZER,)),
        # Older BERT folders have only vocab.txt.
        Family("bert", Text, bert.from_config, bert.rename, (TOKENIZER, VOCAB)),
        Family("vit", Image, vit.from_config, vit.rename, (IMAGE_PROCESSOR,)),
    )
}


def family(model_type: str) -> Family:
    if model_type not in FAMILIES:
        raise ConfigError(
            f"config error: model.pretrained: unknown model_type {model_type!r} "
            f"(supported: {', '.join(sorted(FAMILIES))})"
        )
    return FAMILIES[model_type]


def family_of(base: Pretrained) -> Family:
    """The family of an opened folder, whose preprocessing files must be there."""
    model_type = base.model_type
    supported = ", ".join(sorted(FAMILIES))
    if model_type not in FAMILIES and base.config.get("auto_map"):
        raise base.fail(
            f"model_type {model_type!r} needs the folder's own code (auto_map), which is never "
            f"run; supported: {supported}"
        )
    if model_type not in FAMILIES:
        raise base.fail(f"unknown model_type {model_type!r} (supported: {supported})")
    found = FAMILIES[model_type]
    if not any(base.has(name) for name in found.preprocessing):
        raise base.fail(f"missing {' or '.join(found.preprocessing)}")
    return found


def base_for(model: ModelConfig, takes: type[Preprocessor] | None = None) -> Pretrained | None:
    """The run's pretrained folder (`model.pretrained`), opened and checked, and checked against
    the kind of data it trains on when `takes` is given."""
    if not model.pretrained:
        return None
    base = open_pretrained(model.pretrained)
    wanted = family_of(base).takes
    if takes is not None and not issubclass(takes, wanted):
        raise ConfigError(
            f"config error: model.pretrained: a {base.model_type} model trains on "
            f"{wanted.kind} data, but the dataset is {takes.kind}"
        )
    return base
