"""The pretrained families: one per `model_type` a Hugging Face folder may name. Each is the
kind of data it trains on, the plain `torch.nn` module built from the folder's config (its
architecture, random weights), the renaming of the folder's tensors to that module's, and the
files that carry its preprocessing. A new family is a module and an entry here.

Reading and checking the folder itself is app/pretrained.py (I/O, no torch); this module says
what a folder's model is.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from torch import nn

from app.config import ConfigError, ModelConfig
from app.data.kinds.image import Image
from app.data.kinds.image_text import ImageText
from app.data.kinds.text import Text
from app.data.kinds.tokens import Tokens
from app.data.preprocess import Preprocessor
from app.models import bert, clip, gpt, llama, vit
from app.models.dual_encoder import DualEncoder, Pooled, from_scratch
from app.pretrained import IMAGE_PROCESSOR, TOKENIZER, VOCAB, Pretrained, open_pretrained

Build = Callable[[dict[str, Any], Any, ModelConfig], nn.Module]
# (the folder's tensors, its config.json as settled) -> the module's state dict
Rename = Callable[[dict[str, Any], dict[str, Any]], dict[str, Any]]
# an opened folder -> what its weights settle that config.json does not say (a tied head)
Settle = Callable[[Pretrained], dict[str, Any]]


@dataclass(frozen=True)
class Family:
    model_type: str
    takes: type[Preprocessor]  # the kind of data it trains on
    build: Build  # (architecture, preprocessor, model config) -> module, random weights
    rename: Rename  # the folder's tensors -> the module's state dict
    preprocessing: tuple[str, ...]  # the files, any one of which carries its preprocessing
    # config.json's sizes: key -> the largest value taken (None: the key may be absent).
    sizes: dict[str, int]  # dotted into a section: "text_config.hidden_size"
    optional: tuple[str, ...] = ()  # sizes config.json may leave to their defaults
    divides: tuple[tuple[str, str], ...] = ()  # (width, heads): the heads split the width
    vocab: str | None = None  # the size its tokenizer's ids index (embedding rows)
    also: tuple[str, ...] = ()  # files it needs besides its preprocessing's
    settle: Settle | None = None


LAYERS, WIDTH, VOCAB_ROWS, POSITIONS = 1024, 2**16, 2**22, 2**20
ENCODER = {
    "num_hidden_layers": LAYERS,
    "hidden_size": WIDTH,
    "num_attention_heads": 1024,
    "intermediate_size": 2**18,
}
# The Llama-style decoders: one module (app/models/llama.py), each model_type's differences as config.
DECODER_SIZES = {
    "num_hidden_layers": LAYERS,
    "hidden_size": WIDTH,
    "num_attention_heads": 1024,
    "num_key_value_heads": 1024,
    "head_dim": 4096,
    "intermediate_size": 2**18,
    "vocab_size": VOCAB_ROWS,
    "max_position_embeddings": POSITIONS,
}
DECODERS = tuple(
    Family(
        model_type,
        Tokens,
        llama.from_config,
        llama.rename,
        (TOKENIZER,),
        sizes=DECODER_SIZES,
        optional=("num_key_value_heads", "head_dim"),
        vocab="vocab_size",
        settle=llama.settled,
    )
    for model_type in ("llama", "mistral", "qwen2", "qwen3")
)
FAMILIES: dict[str, Family] = {
    f.model_type: f
    for f in (
        *DECODERS,
        Family(
            "gpt2",
            Tokens,
            gpt.from_gpt2,
            gpt.rename_gpt2,
            (TOKENIZER,),
            sizes={"n_layer": LAYERS, "n_embd": WIDTH, "n_head": 1024, "n_inner": 2**18}
            | {"vocab_size": VOCAB_ROWS, "n_positions": POSITIONS},
            optional=("n_inner",),
            divides=(("n_embd", "n_head"),),
            vocab="vocab_size",
        ),
        Family(
            "bert",
            Text,
            bert.from_config,
            bert.rename,
            (TOKENIZER, VOCAB),  # older BERT folders have only vocab.txt
            sizes=ENCODER
            | {"vocab_size": VOCAB_ROWS, "max_position_embeddings": POSITIONS}
            | {"type_vocab_size": 1024},
            optional=("max_position_embeddings", "type_vocab_size"),
            divides=(("hidden_size", "num_attention_heads"),),
            vocab="vocab_size",
        ),
        Family(
            "vit",
            Image,
            vit.from_config,
            vit.rename,
            (IMAGE_PROCESSOR,),
            sizes=ENCODER | {"image_size": 8192, "patch_size": 8192, "num_channels": 4},
            optional=("image_size", "patch_size", "num_channels"),
            divides=(("hidden_size", "num_attention_heads"),),
        ),
        Family(
            "clip",
            ImageText,
            clip.from_config,
            clip.rename,
            (TOKENIZER,),
            sizes={f"text_config.{k}": v for k, v in ENCODER.items()}
            | {f"vision_config.{k}": v for k, v in ENCODER.items()}
            | {"text_config.vocab_size": VOCAB_ROWS, "text_config.max_position_embeddings": 4096}
            | {"vision_config.image_size": 8192, "vision_config.patch_size": 8192}
            | {"projection_dim": WIDTH},
            divides=(
                ("text_config.hidden_size", "text_config.num_attention_heads"),
                ("vision_config.hidden_size", "vision_config.num_attention_heads"),
            ),
            vocab="text_config.vocab_size",
            also=(IMAGE_PROCESSOR,),
        ),
    )
}


def family(model_type: str) -> Family:
    if model_type not in FAMILIES:
        raise ConfigError(
            f"config error: model.pretrained: unknown model_type {model_type!r} "
            f"(supported: {', '.join(sorted(FAMILIES))})"
        )
    return FAMILIES[model_type]


@functools.lru_cache(maxsize=8)
def family_of(base: Pretrained) -> Family:
    """The family of an opened folder, once the folder is checked: its preprocessing files are
    there, config.json's sizes are sizes, the weights hold every tensor of the shape config.json
    implies (read from the safetensors headers, before any model is built), and the tokenizer's
    ids fit the embedding. Every failure is one line naming the folder and what is wrong."""
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
    for name in found.also:
        if not base.has(name):
            raise base.fail(f"missing {name}")
    check_sizes(base, found)
    if found.settle is not None:  # the architecture as the module reads it (base.record())
        base.config.update(found.settle(base))
    check_weights(base, found)
    if found.vocab:
        check_tokenizer(base, found.vocab)
    return found


def size(config: dict[str, Any], key: str) -> Any:
    """A config.json value by its dotted key (None when absent)."""
    node: Any = config
    for part in key.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


def check_sizes(base: Pretrained, found: Family) -> None:
    for key, largest in found.sizes.items():
        value = size(base.config, key)
        if value is None and key in found.optional:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= largest:
            shown = json.dumps(value)[:40]
            raise base.fail(f"config.json {key}: {shown} is not a size in 1..{largest}")
    for width, heads in found.divides:
        if size(base.config, width) % size(base.config, heads):
            raise base.fail(
                f"config.json {width} {size(base.config, width)} does not split into {heads}"
            )


def check_weights(base: Pretrained, found: Family) -> None:
    """The folder's tensors (shapes only, on the meta device) against the module config.json
    describes, built on the meta device: no memory, whatever the config claims."""
    import torch

    shapes = base.tensor_shapes()
    folder = found.rename(
        {n: torch.empty(s, device="meta") for n, s in shapes.items()}, base.config
    )
    stand_in = SimpleNamespace(labels=["a", "b"], state={"pretrained": {"has_pooler": False}})
    with torch.device("meta"):
        model = found.build(base.config, stand_in, ModelConfig())
    for name, tensor in model.state_dict().items():
        if name.startswith(("head.", "pooler.")):  # new, or optional in the folder
            continue
        if name not in folder:
            raise base.fail(
                f"config.json implies tensor {name} {tuple(tensor.shape)}, which the weights "
                "lack (does config.json describe these weights?)"
            )
        if tuple(folder[name].shape) != tuple(tensor.shape):
            raise base.fail(
                f"tensor {name}: config.json implies {tuple(tensor.shape)}, the weights hold "
                f"{tuple(folder[name].shape)}"
            )


def check_tokenizer(base: Pretrained, vocab: str) -> None:
    base.tokenizer_config()  # read now: a malformed one fails here, not at training
    tokens, rows = base.tokenizer_size(), size(base.config, vocab)
    if tokens > rows:
        raise base.fail(
            f"the tokenizer has {tokens} token ids, more than config.json's vocab_size {rows} "
            "(embedding rows): a token beyond them could not be looked up"
        )


def base_for(model: ModelConfig, takes: type[Preprocessor] | None = None) -> Pretrained | None:
    """The run's pretrained folder (`model.pretrained`), opened and checked, and checked against
    the kind of data it trains on when `takes` is given."""
    if not model.pretrained:
        return None
    base = open_pretrained(model.pretrained)
    base.chat_template()  # compiled and rendered once: a broken template fails here (prepare)
    wanted = family_of(base).takes
    if takes is not None and not issubclass(takes, wanted):
        raise ConfigError(
            f"config error: model.pretrained: a {base.model_type} model trains on "
            f"{wanted.kind} data, but the dataset is {takes.kind}"
        )
    return base


@dataclass(frozen=True)
class Bases:
    """A run's pretrained folders as the data layer asks for them (its `PretrainedLookup`)."""

    model: ModelConfig

    def base(self, takes: type[Preprocessor] | None = None, /) -> Pretrained | None:
        return base_for(self.model, takes)

    def towers(
        self, takes: type[Preprocessor] | None = None, /
    ) -> tuple[Pretrained | None, Pretrained | None]:
        return tower_bases(self.model, takes)


def tower_bases(
    model: ModelConfig, takes: type[Preprocessor] | None = None
) -> tuple[Pretrained | None, Pretrained | None]:
    """(text folder, image folder) of a dual encoder's pretrained towers, each checked to be a
    text or an image family (`model.pretrained_text`, `model.pretrained_image`); either may
    be None (that tower is trained from scratch: LiT's recipe, or its mirror). `takes`: the
    kind of data the run trains on, which must be pictures and captions when a tower is set."""
    key = "pretrained_text" if model.pretrained_text else "pretrained_image"
    if (model.pretrained_text or model.pretrained_image) and takes not in (None, ImageText):
        assert takes is not None
        raise ConfigError(
            f"config error: model.{key}: a dual encoder's tower, for pictures and captions; "
            f"the dataset is {takes.kind}"
        )
    text = image = None
    if model.pretrained_text:
        text = base_for(model.model_copy(update={"pretrained": model.pretrained_text}), Text)
    if model.pretrained_image:
        image = base_for(model.model_copy(update={"pretrained": model.pretrained_image}), Image)
    return text, image


def towers(records: dict[str, dict[str, Any]], pre: Any, cfg: ModelConfig) -> DualEncoder:
    """A dual encoder whose towers are pretrained folders' encoders (their records: `text`,
    `image`) or, for a tower without one, the project's own from scratch; new projections
    into `model.embed_dim`."""
    built: dict[str, nn.Module] = {}
    dims: dict[str, int] = {}
    for name, record in records.items():
        stand_in = SimpleNamespace(labels=["a"], state={"pretrained": record})
        encoder = family(record["model_type"]).build(record["architecture"], stand_in, cfg)
        built[name] = Pooled(encoder)
        dims[name] = int(record["architecture"]["hidden_size"])
    scratch = from_scratch(cfg, pre.vocab_size, pre.output_size, int(pre.state["max_length"]))
    image = built.get("image", scratch.image)
    text = built.get("text", scratch.text)
    image_dim, text_dim = dims.get("image", cfg.dim), dims.get("text", cfg.dim)
    return DualEncoder(image, text, image_dim, text_dim, cfg.embed_dim)
