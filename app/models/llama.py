"""The Llama-style decoder (Llama, Mistral, Qwen2, Qwen3: one module, their differences as config),
in plain `torch.nn`, computing what transformers' modeling files compute.

Token embedding, pre-norm blocks (RMSNorm; grouped-query attention with rotary positions; a
SwiGLU MLP), a final RMSNorm and the LM head `lm_head`: its own matrix, or the token embedding's
(`tied`: one shared Parameter, as GPT-2's, so an optimizer step, a checkpoint and an exported
graph see one table).
`forward(input_ids, position_ids, attention_mask)` gives next-token logits for every position
(and with `targets`, the loss in chunks, app/models/causal.py); `step(...)` is the same computation on a KV cache with explicit positions and mask, written for
tracing (the exported graph, app/tasks/lm/export.py) and shared with GPT's contract
(app/models/gpt.py).

`DecoderArgs.from_config` reads a Hugging Face config.json (app/models/families.py registers it
for `llama`, `mistral`, `qwen2`, `qwen3`): every setting the module does not implement is refused
by its key before any work, never approximated.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from app.errors import ConfigError
from app.models.causal import TokenLoss, VocabLoss
from app.pretrained import attention_window

# The rotary scalings implemented (transformers' `rope_type`): the others are refused by key.
ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class Rope:
    """Rotary positions: base `theta`, and a scaling of the inverse frequencies."""

    theta: float = 10000.0
    scaling: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_positions: int = 8192

    def inverse_frequencies(self, head_dim: int) -> torch.Tensor:
        """transformers' `_compute_*_parameters` for default, linear and llama3 (float32)."""
        steps = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32)
        inv = 1.0 / (self.theta ** (steps / head_dim))
        if self.scaling == "linear":
            return inv / self.factor
        if self.scaling != "llama3":
            return inv
        low_wavelen = self.original_max_positions / self.low_freq_factor
        high_wavelen = self.original_max_positions / self.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / self.factor, inv)
        smooth = (self.original_max_positions / wavelen - self.low_freq_factor) / (
            self.high_freq_factor - self.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)


@dataclass(frozen=True)
class DecoderArgs:
    vocab_size: int
    dim: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ff_dim: int
    max_positions: int
    norm_eps: float = 1e-6
    rope: Rope = Rope()
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm of each head's queries and keys before the rotation
    tied: bool = False  # the LM head is the token embedding
    dropout: float = 0.0

    @classmethod
    def from_config(cls, arch: dict[str, Any], model_type: str, max_length: int, dropout: float):
        """The module a config.json describes (transformers 5's defaults where a key is absent,
        both spellings of the rotary settings); `max_length` is the run's sequence length, which
        an attention window it does not implement must not cut."""
        refuse_unsupported(arch, model_type, max_length)
        heads = int(arch["num_attention_heads"])
        head_dim = arch.get("head_dim") or (
            128 if model_type == "qwen3" else int(arch["hidden_size"]) // heads
        )
        bias = bool(arch.get("attention_bias", False))
        return cls(
            vocab_size=int(arch["vocab_size"]),
            dim=int(arch["hidden_size"]),
            layers=int(arch["num_hidden_layers"]),
            heads=heads,
            kv_heads=int(arch.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            ff_dim=int(arch["intermediate_size"]),
            max_positions=min(
                int(arch["max_position_embeddings"]), attention_window(arch) or 2**62
            ),
            norm_eps=float(arch.get("rms_norm_eps", 1e-6)),
            rope=rope_of(arch),
            qkv_bias=True if model_type == "qwen2" else bias and model_type != "mistral",
            o_bias=bias and model_type in ("llama", "qwen3"),
            mlp_bias=bool(arch.get("mlp_bias", False)) and model_type == "llama",
            qk_norm=model_type == "qwen3",
            tied=bool(arch.get("tie_word_embeddings", False)),
            dropout=dropout,
        )


# --- what the module refuses ---------------------------------------------------------------------


def refuse_unsupported(arch: dict[str, Any], model_type: str, max_length: int) -> None:
    def refuse(key: str, why: str) -> ConfigError:
        return ConfigError(f"config error: model.pretrained: config.json {key}: {why}")

    act = arch.get("hidden_act", "silu")
    if act != "silu":
        raise refuse("hidden_act", f"{act!r} is not supported (supported: silu)")
    rope = rope_parameters(arch)
    scaling = rope.get("rope_type", rope.get("type", "default"))
    if scaling not in ROPE_TYPES:
        raise refuse("rope_scaling", f"type {scaling!r} is not supported ({', '.join(ROPE_TYPES)})")
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise refuse("partial_rotary_factor", "only a full rotation (1.0) is supported")
    window = attention_window(arch)
    if window is not None and window < max_length:
        raise refuse(
            window_key(model_type),
            f"a sliding attention window of {window} tokens is shorter than model.max_length="
            f"{max_length}, and sliding windows are not implemented: lower model.max_length",
        )
    heads, kv = int(arch["num_attention_heads"]), int(arch.get("num_key_value_heads") or 1)
    if heads % kv:
        raise refuse("num_key_value_heads", f"{kv} does not divide num_attention_heads {heads}")


def window_key(model_type: str) -> str:
    return "sliding_window" if model_type == "mistral" else "use_sliding_window"


def rope_parameters(arch: dict[str, Any]) -> dict[str, Any]:
    """The rotary settings in either spelling: transformers 5's `rope_parameters`, or the
    `rope_theta` + `rope_scaling` most folders carry."""
    params = arch.get("rope_parameters") or arch.get("rope_scaling") or {}
    params = dict(params) if isinstance(params, dict) else {}
    params.setdefault("rope_theta", arch.get("rope_theta", 10000.0))
    return params


def rope_of(arch: dict[str, Any]) -> Rope:
    p = rope_parameters(arch)
    return Rope(
        theta=float(p["rope_theta"]),
        scaling=p.get("rope_type", p.get("type", "default")),
        factor=float(p.get("factor", 1.0)),
        low_freq_factor=float(p.get("low_freq_factor", 1.0)),
        high_freq_factor=float(p.get("high_freq_factor", 4.0)),
        original_max_positions=int(
            p.get("original_max_position_embeddings", arch.get("max_position_embeddings", 8192))
        ),
    )


# --- the module ----------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in float32 (as transformers does) and written out, so the
    exported graph needs no fused operator."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Rotary(nn.Module):
    """cos and sin of each position's rotation angles, [batch, tokens, head_dim]."""

    inv_freq: torch.Tensor

    def __init__(self, head_dim: int, rope: Rope):
        super().__init__()
        self.head_dim, self.rope = head_dim, rope
        self.register_buffer("inv_freq", torch.empty(head_dim // 2), persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        self.inv_freq = self.rope.inverse_frequencies(self.head_dim).to(self.inv_freq.device)

    def forward(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        angles = position_ids[..., None].float() * self.inv_freq.float()
        angles = torch.cat([angles, angles], dim=-1)
        return angles.cos(), angles.sin()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [batch, heads, tokens, head_dim] rotated (transformers' rotate_half layout)."""
    cos, sin = cos[:, None].to(x.dtype), sin[:, None].to(x.dtype)
    half = x.shape[-1] // 2
    turned = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + turned * sin


def repeat_heads(x: torch.Tensor, times: int) -> torch.Tensor:
    """[batch, kv_heads, slots, dim] -> [batch, kv_heads * times, slots, dim], each key/value
    head serving `times` query heads in a row (transformers' repeat_kv)."""
    if times == 1:
        return x
    b, h, s, d = x.shape
    return x[:, :, None].expand(b, h, times, s, d).reshape(b, h * times, s, d)


class Attention(nn.Module):
    def __init__(self, a: DecoderArgs):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = a.heads, a.kv_heads, a.head_dim
        self.q_proj = nn.Linear(a.dim, a.heads * a.head_dim, bias=a.qkv_bias)
        self.k_proj = nn.Linear(a.dim, a.kv_heads * a.head_dim, bias=a.qkv_bias)
        self.v_proj = nn.Linear(a.dim, a.kv_heads * a.head_dim, bias=a.qkv_bias)
        self.o_proj = nn.Linear(a.heads * a.head_dim, a.dim, bias=a.o_bias)
        self.q_norm = RMSNorm(a.head_dim, a.norm_eps) if a.qk_norm else None
        self.k_norm = RMSNorm(a.head_dim, a.norm_eps) if a.qk_norm else None
        self.dropout = a.dropout

    def projected(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries, keys and values [batch, heads, tokens, head_dim], rotated."""
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.heads, self.head_dim)
        k = self.k_proj(x).view(b, t, self.kv_heads, self.head_dim)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return rotate(q.transpose(1, 2), cos, sin), rotate(k.transpose(1, 2), cos, sin), v

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        """Training and scoring: every query sees the keys `mask` allows (None: causal)."""
        q, k, v = self.projected(x, cos, sin)
        out = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            dropout_p=self.dropout if self.training else 0.0,
            is_causal=mask is None,
            enable_gqa=self.kv_heads != self.heads,
        )
        return self.o_proj(out.transpose(1, 2).flatten(2))

    def cached(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        visible: torch.Tensor,
        past: tuple[torch.Tensor, torch.Tensor],
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """On a cache of `kv_heads` heads: the new keys and values appended, the heads repeated
        explicitly for the product (an exported graph has no grouped attention)."""
        q, k, v = self.projected(x, cos, sin)
        k, v = torch.cat([past[0], k], dim=2), torch.cat([past[1], v], dim=2)
        times = self.heads // self.kv_heads
        out = F.scaled_dot_product_attention(
            q, repeat_heads(k, times), repeat_heads(v, times), attn_mask=visible
        )
        return self.o_proj(out.transpose(1, 2).flatten(2)), (k, v)


class SwiGLU(nn.Module):
    def __init__(self, a: DecoderArgs):
        super().__init__()
        self.gate_proj = nn.Linear(a.dim, a.ff_dim, bias=a.mlp_bias)
        self.up_proj = nn.Linear(a.dim, a.ff_dim, bias=a.mlp_bias)
        self.down_proj = nn.Linear(a.ff_dim, a.dim, bias=a.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderBlock(nn.Module):
    """Pre-norm: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, a: DecoderArgs):
        super().__init__()
        self.attn_norm = RMSNorm(a.dim, a.norm_eps)
        self.attn = Attention(a)
        self.mlp_norm = RMSNorm(a.dim, a.norm_eps)
        self.mlp = SwiGLU(a)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin, mask)
        return x + self.mlp(self.mlp_norm(x))

    def cached(self, x, cos, sin, visible, past):
        attended, present = self.attn.cached(self.attn_norm(x), cos, sin, visible, past)
        x = x + attended
        return x + self.mlp(self.mlp_norm(x)), present


class LlamaLM(nn.Module):
    """A Llama-style causal language model."""

    # LoRA's default targets (train.lora_targets unset): every projection of attention and MLP.
    LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

    def __init__(self, a: DecoderArgs):
        super().__init__()
        self.args = a
        self.block_size = a.max_positions
        self.tokens = nn.Embedding(a.vocab_size, a.dim)
        self.rotary = Rotary(a.head_dim, a.rope)
        self.blocks = nn.ModuleList(DecoderBlock(a) for _ in range(a.layers))
        self.norm = RMSNorm(a.dim, a.norm_eps)
        self.lm_head = nn.Linear(a.dim, a.vocab_size, bias=False)
        if a.tied:  # one matrix embeds and un-embeds
            self.lm_head.weight = self.tokens.weight
        self.vocab_loss = VocabLoss()

    @property
    def kv_heads(self) -> int:
        return self.args.kv_heads

    @property
    def head_dim(self) -> int:
        return self.args.head_dim

    def head_weight(self) -> torch.Tensor:
        return self.lm_head.weight

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self.norm(x), self.head_weight())

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        targets: torch.Tensor | None = None,
    ) -> torch.Tensor | TokenLoss:
        """[batch, tokens] ids -> [batch, tokens, vocab] logits, or given `targets` (the next
        ids, IGNORE where untrained) the loss (app/models/causal.py). `position_ids` default to
        0, 1, ...; `attention_mask` is [batch, tokens] (1 real, 0 padding), or a boolean
        [batch, 1, tokens, tokens] of which keys each query sees (packed sequences)."""
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device)[None]
        cos, sin = self.rotary(position_ids)
        mask = visibility(attention_mask, input_ids.shape[1])
        x = self.tokens(input_ids)
        for block in self.blocks:
            x = block(x, cos, sin, mask)
        if targets is None:
            return self.logits(x)
        return self.vocab_loss(x, self.norm, self.head_weight(), targets)

    def step(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        past: Sequence[torch.Tensor],
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The decoder on a KV cache (app/models/gpt.py's contract): hidden states of `input_ids`
        [batch, tokens] after `past` (key, value per block), and the cache extended by them.
        Every shape comes from tensors, for tracing."""
        visible = cache_visibility(input_ids, attention_mask, past[0].shape[2])
        cos, sin = self.rotary(position_ids)
        x = self.tokens(input_ids)
        presents: list[torch.Tensor] = []
        for i, block in enumerate(self.blocks):
            x, (k, v) = cast(DecoderBlock, block).cached(
                x, cos, sin, visible, (past[2 * i], past[2 * i + 1])
            )
            presents += [k, v]
        return x, presents


def visibility(attention_mask: torch.Tensor | None, tokens: int) -> torch.Tensor | None:
    """The boolean [batch, 1, tokens, tokens] keys-each-query-sees mask: causal among the real
    tokens of a padded batch; None for an unpadded one (causal attention needs no mask). Each
    query sees at least itself, so a padding row's softmax is never empty."""
    if attention_mask is None:
        return None
    if attention_mask.dim() == 4:
        return attention_mask
    device = attention_mask.device
    causal = torch.ones(tokens, tokens, dtype=torch.bool, device=device).tril()
    real = attention_mask[:, None, None, :].bool()
    return (causal & real) | torch.eye(tokens, dtype=torch.bool, device=device)


def cache_visibility(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, cached: Any
) -> torch.Tensor:
    """[batch, 1, tokens, slots]: the new tokens fill the last slots; a query sees the valid
    slots (`attention_mask` [batch, slots], 1 or 0) up to its own."""
    tokens = input_ids.shape[1]
    query_slots = torch.arange(tokens, device=input_ids.device) + cached
    key_slots = torch.arange(attention_mask.shape[1], device=input_ids.device)
    causal = key_slots.unsqueeze(0) <= query_slots.unsqueeze(1)
    return causal[None, None] & (attention_mask[:, None, None, :] > 0)


def from_config(arch: dict[str, Any], pre: Any, cfg: Any) -> LlamaLM:
    """The decoder of a pretrained folder's config.json (the family's `build`)."""
    model_type = str(arch.get("model_type"))
    length = cfg.max_length or 0  # unset: the folder's own limit, within any window
    return LlamaLM(DecoderArgs.from_config(arch, model_type, length, cfg.dropout))


# The folder's tensor names -> the module's (transformers' LlamaForCausalLM layout).
BLOCK = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn.q_proj",
    "self_attn.k_proj": "attn.k_proj",
    "self_attn.v_proj": "attn.v_proj",
    "self_attn.o_proj": "attn.o_proj",
    "self_attn.q_norm": "attn.q_norm",
    "self_attn.k_norm": "attn.k_norm",
    "post_attention_layernorm": "mlp_norm",
    "mlp.gate_proj": "mlp.gate_proj",
    "mlp.up_proj": "mlp.up_proj",
    "mlp.down_proj": "mlp.down_proj",
}
EMBEDDING, HEAD = "model.embed_tokens.weight", "lm_head.weight"


def rename(state: dict[str, Any], arch: dict[str, Any]) -> dict[str, Any]:
    """The folder's tensors under the module's names. A tied module's embedding and head are
    one tensor: whichever of the two the folder holds (the family checked they are equal when
    it holds both: `settled`) goes under both names."""
    from app.models.encoder import block_rules, renamed

    state = dict(state)
    if arch.get("tie_word_embeddings"):
        table = state.get(EMBEDDING, state.get(HEAD))
        if table is not None:
            state[EMBEDDING] = state[HEAD] = table
    rules = [
        (r"embed_tokens\.weight", "tokens.weight"),
        *block_rules("layers", BLOCK),
        (r"norm\.weight", "norm.weight"),
    ]
    return renamed(state, ("model.",), rules, r"layers\.\d+\.self_attn\.rotary_emb\..*")


def settled(base: Any) -> dict[str, Any]:
    """What the weights settle that config.json does not say alone, transformers 5's rule for a
    tied head: the embedding and `lm_head.weight` both present and equal, or only one of them
    present, make one table; both present and different, two."""
    stored = base.stored()
    embedding, head = stored.get(EMBEDDING), stored.get(HEAD)
    tied = embedding is None or head is None or same_values(embedding, head)
    return {"tie_word_embeddings": tied}


def same_values(a: Any, b: Any, rows: int = 4096) -> bool:
    """Whether two stored tensors hold the same values, read a block of rows at a time."""
    first, second = a.read(range(0, 1)), b.read(range(0, 1))
    if first.shape[1:] != second.shape[1:] or first.dtype != second.dtype:
        return False
    from safetensors import safe_open

    with safe_open(a.path, framework="pt") as f:
        length = f.get_slice(a.name).get_shape()[0]
    with safe_open(b.path, framework="pt") as f:
        if f.get_slice(b.name).get_shape()[0] != length:
            return False
    return all(
        torch.equal(
            a.read(range(s, min(s + rows, length))), b.read(range(s, min(s + rows, length)))
        )
        for s in range(0, length, rows)
    )
