"""What training does differently to a model it fine-tunes: LoRA adapters, frozen weights, weight
decay by parameter kind, and the memory a worker needs, checked before any worker starts.

All of it reads `train.*` keys and works on any `nn.Module`; the pretrained classes name their
embeddings (`EMBEDDINGS`) and their new head (`head`).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn

from app.config import Config, TrainConfig
from app.errors import ConfigError
from app.models.init import initialise
from app.models.lora import apply_lora

GIB = 2**30
# LoRA's targets in a model that names none of its own (`LORA_TARGETS`): BERT's and ViT's
# attention projections, GPT's fused one.
DEFAULT_LORA_TARGETS = ("query", "value", "attn.qkv")
TOWERS = {"image": ("image",), "text": ("text",), "towers": ("image", "text")}


def trainable_model(
    config: Config, pre: Any, base_weights: bool = False, meta: bool = False
) -> nn.Module:
    """The model as training holds it: built, LoRA adapters added, its initial weights drawn
    from `train.seed` module by module (app/models/init.py; a user's own `pkg.module:callable`
    model built whole keeps its constructor's), the pretrained folder's weights
    copied in (`base_weights`: a fresh run's first start), frozen where asked. `meta`: the
    structure alone, on the meta device (a sharded rank then materialises only its part:
    app/train/materialise.py)."""
    from app.models import build_model, has_pretrained, is_custom, load_pretrained

    with torch.device("meta") if meta else contextlib.nullcontext():
        model = adapt(build_model(config.model, pre), config.train)
    if not meta:
        if not is_custom(config.model, pre):  # a user's own model keeps its constructor's
            initialise(model, config.train.seed)
        if base_weights and has_pretrained(pre):
            load_pretrained(model, pre)
    freeze(model, config.train)
    return model


def adapt(model: nn.Module, t: TrainConfig) -> nn.Module:
    """The structure training adds (LoRA adapters); applied before weights are loaded, so
    pretrained weights and checkpoints both load into it."""
    if t.lora_rank:
        targets = t.lora_targets or list(getattr(model, "LORA_TARGETS", DEFAULT_LORA_TARGETS))
        apply_lora(model, t.lora_rank, t.lora_alpha, targets)
    return model


def freeze(model: nn.Module, t: TrainConfig) -> None:
    """Turn off gradients for what `train.freeze` and LoRA keep fixed; a model left with
    nothing to train is a config error."""
    if t.lora_rank:  # the adapters and the new head train; the backbone stays
        for name, p in model.named_parameters():
            p.requires_grad_(".lora_" in name or name.startswith("head."))
    if t.freeze == "backbone":
        for name, p in model.named_parameters():
            p.requires_grad_(p.requires_grad and name.startswith("head."))
    elif t.freeze == "embeddings":
        embeddings = getattr(model, "EMBEDDINGS", ("embeddings",))
        for name, p in model.named_parameters():
            if name.split(".")[0] in embeddings:
                p.requires_grad_(False)
    elif t.freeze in TOWERS:  # a dual encoder: its projections and temperature train on
        for name, p in model.named_parameters():
            if name.split(".")[0] in TOWERS[t.freeze]:
                p.requires_grad_(False)
    if not any(p.requires_grad for p in model.parameters()):
        raise ConfigError(
            f"config error: train.freeze: {t.freeze} leaves this model nothing to train "
            "(it has no new head: a language model keeps its own)"
        )


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """AdamW groups: weight matrices decay; biases, norms' scales and other 1-d tensors don't."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]


def adamw(model: nn.Module, t: TrainConfig) -> torch.optim.AdamW:
    """AdamW over `param_groups`, fused on CPU and CUDA: one kernel a tensor updating it in
    place, faster than the loop over tensors and with no temporaries the size of the largest
    one (its square root and quotient: twice a GPT-2 embedding, bench/b26)."""
    groups = param_groups(model, t.weight_decay)
    devices = {p.device.type for group in groups for p in group["params"]}
    return torch.optim.AdamW(groups, lr=t.lr, fused=devices <= {"cpu", "cuda"})


def memory_per_worker(model: nn.Module, t: TrainConfig) -> dict[str, int]:
    """Bytes a worker holds for fp32 weights, gradients and AdamW's two moments (FSDP: its
    shard of each). Activations come on top and depend on batch and sequence length."""
    # Elastic: the fewest ranks hold most; a pipeline's stages hold about equal parts.
    share = t.min_workers if t.strategy == "fsdp" else t.stages
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return {
        "weights": 4 * total // share,
        "gradients": 4 * trainable // share,
        "optimizer": 8 * trainable // share,
    }


def check_fits(estimate: dict[str, int], t: TrainConfig, available: float | None) -> None:
    """Refuse a run whose workers cannot hold the model (`available`: bytes per worker)."""
    need = sum(estimate.values())
    if available is None or need <= available:
        return
    parts = ", ".join(f"{k} {v / GIB:.2f}" for k, v in estimate.items())
    raise ConfigError(
        f"config error: train: each worker needs about {need / GIB:.1f} GiB ({parts}) but has "
        f"about {available / GIB:.1f} GiB; use train.strategy=fsdp or pipeline, train.freeze, "
        "train.lora_rank or fewer train.num_workers"
    )


def check_initialisable(model: nn.Module, t: TrainConfig) -> None:
    """FSDP and pipeline ranks build the model on the meta device and draw only their part of
    it: every tensor needs a rule that draws it (app/models/init.py)."""
    from app.models.init import uncovered

    missing = uncovered(model) if t.strategy != "ddp" else []
    if missing:
        raise ConfigError(
            f"config error: train.strategy: {t.strategy} draws each rank's part of the model "
            f"module by module, but nothing draws {missing[:3]}: give their module a "
            "reset_parameters() (as torch.nn's layers have)"
        )
