"""LoRA (Hu et al., 2021): low-rank adapters on chosen Linear layers, merged back for export.

`LoRALinear` is an `nn.Linear` (its `weight` and `bias` keep their names, so pretrained weights
and checkpoints load as before) plus `lora_a` [rank, in] and `lora_b` [out, rank]:
y = x W^T + b + (alpha / rank) * x A^T B^T. B starts at zero, so training starts from the base
model exactly. `merge_lora` folds each adapter into its weight and puts a plain `nn.Linear` back:
the exported graph and the served model are the same as without LoRA.
"""

from __future__ import annotations

import math
import re

import torch
import torch.nn.functional as F
from torch import nn


class LoRALinear(nn.Linear):
    def __init__(self, base: nn.Linear, rank: int, alpha: float):
        super().__init__(base.in_features, base.out_features, bias=base.bias is not None)
        self.weight = base.weight
        self.bias = base.bias
        self.scale = alpha / rank
        self.lora_a = nn.Parameter(torch.empty(rank, base.in_features))
        self.lora_b = nn.Parameter(torch.empty(base.out_features, rank))
        self.reset_lora()

    def reset_parameters(self) -> None:
        super().reset_parameters()
        if "lora_a" in self._parameters:  # nn.Linear's constructor calls this before they exist
            self.reset_lora()

    def reset_lora(self) -> None:
        """B starts at zero, so the adapted layer starts as the base layer."""
        nn.init.kaiming_uniform_(self.lora_a, a=math.sqrt(5))
        nn.init.zeros_(self.lora_b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + F.linear(F.linear(x, self.lora_a), self.lora_b) * self.scale

    def merged(self) -> nn.Linear:
        linear = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None)
        with torch.no_grad():
            linear.weight.copy_(self.weight + self.scale * (self.lora_b @ self.lora_a))
            if self.bias is not None:
                linear.bias.copy_(self.bias)
        return linear


def apply_lora(model: nn.Module, rank: int, alpha: float, targets: list[str]) -> list[str]:
    """Wrap every Linear whose name ends with one of `targets` (a dotted suffix such as
    "query" or "attn.qkv"); returns the wrapped names. None matching is an error naming them."""
    pattern = re.compile(r"(^|.*\.)(" + "|".join(re.escape(t) for t in targets) + r")$")
    wrapped = []
    for name, module in list(model.named_modules()):
        plain = isinstance(module, nn.Linear) and not isinstance(module, LoRALinear)
        if plain and pattern.match(name):
            _replace(model, name, LoRALinear(module, rank, alpha))
            wrapped.append(name)
    if not wrapped:
        linear = sorted(
            {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)}
        )
        from app.errors import ConfigError

        raise ConfigError(
            f"config error: train.lora_targets: {targets} match no Linear layer "
            f"(the model's Linear layers end in: {', '.join(linear)})"
        )
    return wrapped


def merge_lora(model: nn.Module) -> nn.Module:
    """Fold every adapter into its weight, in place; returns the model."""
    for name, module in list(model.named_modules()):
        if isinstance(module, LoRALinear):
            _replace(model, name, module.merged())
    return model


def _replace(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)
