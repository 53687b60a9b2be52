"""Task `lm`'s export parts (app/export/exporter.py runs the flow): a causal LM of any family
that keeps app/models/causal.py's contract, as ONNX with a KV cache, int8 weights, the gate.

One graph serves both phases of generation: `input_ids` [batch, tokens] after a cache of
`past_key_<i>` / `past_value_<i>` per block ([batch, kv_heads, cached, head_dim]; 0 cached for
a prompt) -> `logits` of the positions `logit_positions` names and `present_key_<i>` /
`present_value_<i>`, the cache extended by those tokens. The prompt is fed once and every later
token alone (app/runtime/kv.py). A grouped-query model's cache holds its key/value heads only;
the graph repeats them for the product. A graph beyond `export.external_data_bytes` keeps its
weights in one external-data file beside it (hashed in the manifest like every file).

int8 is weight-only (MatMulNBits blocks of the weight matrices, the LM head's too, and int8
rows of the embedding; attention's activation x activation products stay fp32). The gate
compares the two ONNX variants on held-out data: perplexity on validation sequences (allowed
relative increase `export.max_perplexity_increase`) and greedy-decoding agreement on validation
prompts (`export.min_greedy_agreement`), plus the fp32 graph's parity with torch's `step`.
"""

from __future__ import annotations

import logging
import math
import os
import platform
import statistics
import time
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from app.config import Config
from app.data.kinds.tokens import tokens_of
from app.errors import UserError
from app.export.compile_programs import not_for_task
from app.export.exporter import ExportParts, Quality, Report, parity_refusal, sizes
from app.export.onnx_graph import write_onnx
from app.export.quantize import WEIGHT_BLOCK, quantize_weight_only
from app.models.causal import IGNORE, CausalLM, causal_lm, empty_cache
from app.runtime import artifact as art
from app.runtime.kv import (
    KEY_MASK,
    LOGIT_POSITIONS,
    POSITIONS,
    KVDecoder,
    greedy,
    past_name,
    present_name,
    prompt_step,
)
from app.train.checkpoint import LoadedCheckpoint

log = logging.getLogger(__name__)
WHY_ONNX_ONLY = (
    "language models run ONNX Runtime's KV-cache decode graph, which the decode loop batches"
)
TOKENIZER_FILE = "tokenizer.json"  # the artifact's copy, usable by any `tokenizers` client
LOGITS_BUDGET_BYTES = 64 * 2**20  # per ONNX Runtime call while scoring perplexity


@dataclass(frozen=True)
class HeldOut:
    """Validation sequences the gate scores, one a row ([n, width], padded at the end; a chat
    dataset's packed rows taken apart) and which of their tokens are counted targets."""

    rows: np.ndarray  # int64 ids
    trained: np.ndarray  # bool; never a row's first token

    @classmethod
    def text(cls, rows: np.ndarray) -> HeldOut:
        """Rows of a text corpus: every token but a row's first is a target."""
        trained = np.ones(rows.shape, dtype=bool)
        trained[:, 0] = False
        return cls(rows, trained)

    def targets(self) -> int:
        return int(self.trained.sum())

    def prompts(self, count: int, longest: int, text_tokens: int) -> list[list[int]]:
        """Greedy-decoding prompts: a chat sequence up to its first trained token (what the
        model answers), a text row's first `text_tokens`; at most `longest` tokens each."""
        out = []
        for row, trained in zip(self.rows[:count], self.trained[:count], strict=True):
            first = int(np.argmax(trained))  # a text row's is 1: every token after the first
            end = first if first > 1 else text_tokens
            out.append(row[: max(1, min(end, longest))].tolist())
        return out


def held_out(config: Config, loaded: LoadedCheckpoint) -> HeldOut:
    """The validation sequences the gate scores (`validation_rows`), once the model is known to
    keep the causal LM contract the graph is written for (app/models/causal.py)."""
    if causal_lm(loaded.model) is None:
        raise UserError(
            f"export of task lm: {type(loaded.model).__name__} does not keep the causal LM "
            "contract of app/models/causal.py (step, logits, kv_heads, head_dim)"
        )
    return validation_rows(config, loaded, config.export.perplexity_rows)


def model_of(loaded: LoadedCheckpoint) -> CausalLM:
    return cast(CausalLM, loaded.model)


def write_graphs(config: Config, loaded: LoadedCheckpoint, rows: HeldOut, work: str) -> None:
    path = os.path.join(work, art.MODEL_FILES["fp32"])
    export_kv_onnx(model_of(loaded), path, config.export.opset, config.export.external_data_bytes)


def quantize(config: Config, loaded: LoadedCheckpoint, rows: HeldOut, work: str) -> Report:
    """int8 weights (weight-only; the LM head's too), then both variants measured on the
    validation rows."""
    fp32, int8 = (os.path.join(work, art.MODEL_FILES[v]) for v in ("fp32", "int8"))
    quantize_weight_only(fp32, int8, gemm_weights=True)
    return measure(config, model_of(loaded), fp32, int8, rows)


def programs(
    config: Config, loaded: LoadedCheckpoint, rows: HeldOut, work: str, report: Report
) -> dict[str, Any]:
    report["programs"] = not_for_task(config, "lm", WHY_ONNX_ONLY)
    return {}


def files(loaded: LoadedCheckpoint) -> dict[str, bytes]:
    """The tokenizer, usable by any `tokenizers` client."""
    return {TOKENIZER_FILE: tokens_of(loaded.preprocessor).tokenizer.to_str().encode()}


def quality(report: Report) -> Quality:
    ppl = report["perplexity"]
    latency = report["latency_ms_per_token"]
    return Quality(
        metric=f"val perplexity, {report['perplexity_tokens']} tokens",
        key="perplexity",
        values={
            "torch_fp32": ppl["torch_fp32"],
            "onnx_fp32": ppl["fp32"],
            "onnx_int8": ppl["int8"],
        },
        higher_is_better=False,
        latency_ms={v: {"a token": ms} for v, ms in latency.items()},
    )


def schema(loaded: LoadedCheckpoint, task: str) -> dict[str, Any]:
    """schema.json of a language model: text in, text out, the graph's cache layout and the
    generation settings (its end ids)."""
    model, pre = model_of(loaded), tokens_of(loaded.preprocessor)
    layers = len(model.blocks)
    return {
        "kind": pre.kind,
        "task": task,
        "inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [1]}],
        "outputs": [{"name": "text_output", "datatype": "BYTES", "shape": [1]}],
        "labels": [],
        "model_inputs": [*GRAPH_INPUTS, *cache_names(layers, past_name)],
        "model_outputs": ["logits", *cache_names(layers, present_name)],
        "block_size": model.block_size,
        "vocab_size": int(model.head_weight().shape[0]),
        "layers": layers,
        "kv_heads": model.kv_heads,
        "head_dim": model.head_dim,
        "tokenizer": TOKENIZER_FILE,
        "end_ids": pre.end_ids,
    }


def cache_names(layers: int, name) -> list[str]:
    return [name(kind, i) for i in range(layers) for kind in ("key", "value")]


# --- the graph -----------------------------------------------------------------------------------

GRAPH_INPUTS = ["input_ids", POSITIONS, KEY_MASK, LOGIT_POSITIONS]


class KVGraph(nn.Module):
    """A causal LM's `step` (app/models/causal.py) as one graph for both phases of generation,
    returning the logits of the positions `logit_positions` [batch, n] names only: a prompt's
    last (or each row's last real one), a step's one, or every position when scoring. The LM
    head reads its matrix untransposed (a Gemm on the selected rows, which a bias makes of
    torch's linear), so a head tied to the token embedding stays one initializer."""

    no_bias: torch.Tensor

    def __init__(self, model: CausalLM):
        super().__init__()
        self.model = cast(nn.Module, model)
        self.vocab = int(model.head_weight().shape[0])  # a constant: the logits' last axis
        self.register_buffer("no_bias", torch.zeros(self.vocab), persistent=False)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        logit_positions: torch.Tensor,
        *past: torch.Tensor,
    ) -> tuple[torch.Tensor, ...]:
        model = cast(CausalLM, self.model)
        hidden, presents = model.step(input_ids, position_ids, attention_mask, past)
        batch, picked = logit_positions.shape
        width = hidden.shape[-1]
        rows = hidden.gather(1, logit_positions[..., None].expand(batch, picked, width))
        normed = model.norm(rows.reshape(batch * picked, width))
        logits = F.linear(normed, model.head_weight(), self.no_bias)  # 2-D, a bias: a Gemm
        return (logits.reshape(batch, picked, self.vocab), *presents)


def export_kv_onnx(
    model: CausalLM, path: str, opset: int, external_bytes: int | None = None
) -> None:
    layers = len(model.blocks)
    inputs = [*GRAPH_INPUTS, *cache_names(layers, past_name)]
    outputs = ["logits", *cache_names(layers, present_name)]
    # Traced with a cache and a multi-token chunk so that no length is a special case.
    ids = torch.zeros(1, 2, dtype=torch.long)
    positions, mask = torch.tensor([[1, 2]]), torch.ones(1, 3, dtype=torch.long)
    picked = torch.tensor([[0, 1]])
    past = [torch.zeros(1, model.kv_heads, 1, model.head_dim) for _ in range(2 * layers)]
    dynamic = {"input_ids": {0: "batch", 1: "tokens"}, "logits": {0: "batch", 1: "picked"}}
    dynamic |= {POSITIONS: {0: "batch", 1: "tokens"}, KEY_MASK: {0: "batch", 1: "total"}}
    dynamic |= {LOGIT_POSITIONS: {0: "batch", 1: "picked"}}
    dynamic |= {n: {0: "batch", 2: "past"} for n in inputs[len(GRAPH_INPUTS) :]}
    dynamic |= {n: {0: "batch", 2: "total"} for n in outputs[1:]}
    args = (ids, positions, mask, picked, *past)
    write_onnx(KVGraph(model), args, path, inputs, outputs, dynamic, opset, external_bytes)


# --- held-out data ------------------------------------------------------------------------------


def validation_rows(config: Config, loaded: LoadedCheckpoint, limit: int) -> HeldOut:
    """Up to `limit` validation sequences, spread evenly over the split."""
    from app.data.packing import padded, unpacked
    from app.data.prepare import read_manifest, split_files
    from app.tasks.lm.train import SEGMENTS_KEY, TOKENS_KEY, TRAINED_KEY, token_rows

    manifest = read_manifest(config.data_output)
    batches = list(token_rows(split_files(config.data_output, manifest, "val")))
    if not batches:
        raise UserError(f"{config.data_output}: the val split is empty; nothing to gate on")
    rows = np.concatenate([b[TOKENS_KEY] for b in batches])
    if TRAINED_KEY in batches[0]:  # chat rows: each conversation alone
        trained = np.concatenate([b[TRAINED_KEY] for b in batches])
        segments = np.concatenate([b[SEGMENTS_KEY] for b in batches])
        sequences = list(unpacked(rows, trained, segments))
        picked = spread(len(sequences), limit)
        ids, flags = padded([sequences[i] for i in picked], rows.shape[1], 0)
        return HeldOut(ids.astype(np.int64), flags.astype(bool))
    return HeldOut.text(rows[spread(len(rows), limit)])


def spread(count: int, limit: int) -> np.ndarray:
    return np.unique(np.linspace(0, count - 1, num=min(limit, count)).round().astype(int))


# --- verification -------------------------------------------------------------------------------


def measure(config: Config, model: CausalLM, fp32: str, int8: str, rows: HeldOut) -> Report:
    e = config.export
    decoders = {
        v: KVDecoder(art.create_session(art.local_graph(p)))
        for v, p in (("fp32", fp32), ("int8", int8))
    }
    parity = decode_parity(model, decoders["fp32"], rows.rows)
    ppl = {v: perplexity(d, rows) for v, d in decoders.items()}
    with torch.no_grad():
        ppl["torch_fp32"] = math.exp(torch_loss(model, rows))
    longest = max(1, model.block_size - e.greedy_tokens)
    prompts = rows.prompts(e.greedy_prompts, longest, e.greedy_prompt_tokens)
    agreement = greedy_agreement(decoders, prompts, e.greedy_tokens)
    size = sizes(
        os.path.dirname(fp32),
        {"fp32": [art.MODEL_FILES["fp32"]], "int8": [art.MODEL_FILES["int8"]]},
    )
    log.info(
        "export: perplexity %s greedy agreement %.3f sizes %s parity %.2e",
        ppl,
        agreement["token_agreement"],
        size["size_bytes"],
        parity["max_abs_diff"],
    )
    return {
        "parity": parity,
        "perplexity": ppl,
        "perplexity_rows": int(len(rows.rows)),
        "perplexity_tokens": rows.targets(),
        "perplexity_increase": ppl["int8"] / ppl["fp32"] - 1,
        "greedy": agreement,
        **size,
        "latency_ms_per_token": {
            v: token_latency_ms(d, prompts[0], model.block_size) for v, d in decoders.items()
        },
        "quantization": {
            "method": "weight_only",
            "weight_bits": 8,
            "compute": "int8",  # each row's activation blocks quantized in the kernel
            "block_size": WEIGHT_BLOCK,
            "ops": ["MatMul", "Gather"],
            "batch_independent": True,  # activations stay fp32: no per-call scales
            "excluded_nodes": [],
        },
        "thresholds": {
            "parity_tolerance": e.parity_tolerance,
            "max_perplexity_increase": e.max_perplexity_increase,
            "min_greedy_agreement": e.min_greedy_agreement,
            "max_size_ratio": e.max_size_ratio,
        },
        "machine": {"cpu": platform.processor() or platform.machine(), "threads": 1},
    }


@torch.no_grad()
def decode_parity(model: CausalLM, decoder: KVDecoder, rows: np.ndarray, steps: int = 4) -> dict:
    """ONNX fp32 against torch's `step`: a prompt (half a row) fed at once, then `steps` tokens
    one at a time on the cache, for up to 4 rows (max abs logit difference)."""
    diffs = []
    half = max(1, min(rows.shape[1] - 1, model.block_size) - steps)
    for row in rows[:4]:
        ids = torch.from_numpy(row[: half + steps]).unsqueeze(0)
        past = empty_cache(model)
        got, cache = decoder.step(ids[:, :half].numpy(), decoder.empty_cache())
        for start, end in [(0, half), *((t, t + 1) for t in range(half, half + steps))]:
            if start:
                got, cache = decoder.step(ids[:, start:end].numpy(), cache)
            hidden, past = model.step(
                ids[:, start:end],
                torch.arange(start, end)[None],
                torch.ones(1, end, dtype=torch.long),
                past,
            )
            diffs.append(np.abs(got - model.logits(hidden).numpy()).max())
    return {
        "rows": min(4, len(rows)),
        "prompt_tokens": half,
        "incremental_steps": steps,
        "max_abs_diff": float(max(diffs)),
    }


def perplexity(decoder: KVDecoder, held: HeldOut) -> float:
    """exp(mean next-token cross entropy) over every counted target of `held`, the prompt path
    (no cache), in slices whose logits stay under LOGITS_BUDGET_BYTES."""
    rows, trained = held.rows, held.trained
    per_row = 4 * (rows.shape[1] - 1) * decoder.vocab_size
    chunk = max(1, LOGITS_BUDGET_BYTES // per_row)
    total = 0.0
    for start in range(0, len(rows), chunk):
        part = rows[start : start + chunk]
        logits, _ = decoder.step(part[:, :-1], decoder.empty_cache(len(part)))
        total += cross_entropy_sum(logits, part[:, 1:], trained[start : start + chunk, 1:])
    return math.exp(min(total / max(held.targets(), 1), 50.0))


def cross_entropy_sum(logits: np.ndarray, targets: np.ndarray, counted: np.ndarray) -> float:
    z = logits[counted].astype(np.float64)
    z -= z.max(axis=-1, keepdims=True)
    log_norm = np.log(np.exp(z).sum(axis=-1))
    picked = np.take_along_axis(z, targets[counted][..., None], axis=-1)[..., 0]
    return float((log_norm - picked).sum())


def torch_loss(model: CausalLM, held: HeldOut) -> float:
    ids = torch.from_numpy(held.rows)
    targets = torch.where(torch.from_numpy(held.trained[:, 1:]), ids[:, 1:], IGNORE)
    return float(model(ids[:, :-1], targets=targets).mean)


def greedy_agreement(
    decoders: dict[str, KVDecoder], prompts: list[list[int]], tokens: int
) -> dict[str, Any]:
    """How often int8 picks fp32's greedy token, given the same text so far.

    fp32 decodes each prompt greedily; int8 then reads that same continuation (teacher
    forcing) and its argmax at every position is compared with fp32's choice. Each
    position is one decision, so a near-tie that flips early does not also count every later
    token as a disagreement (free-running continuations diverge for good after one flip, which
    made the figure swing by 1/prompts on a single near-tie). `prefix_agreement` is how far the
    two free-running greedy continuations agree before their first difference.
    """
    same, prefix = [], []
    for prompt in prompts:
        path = greedy(decoders["fp32"], prompt, tokens)
        picks = forced_picks(decoders["int8"], prompt, path)
        same.append(float(np.mean([a == b for a, b in zip(path, picks, strict=True)])))
        free = greedy(decoders["int8"], prompt, tokens)
        matches = [a == b for a, b in zip(path, free, strict=True)]
        prefix.append((matches + [False]).index(False) / tokens)
    return {
        "prompts": len(prompts),
        "prompt_tokens": len(prompts[0]) if prompts else 0,
        "tokens": tokens,
        "token_agreement": float(np.mean(same)),
        "prefix_agreement": float(np.mean(prefix)),
    }


def forced_picks(decoder: KVDecoder, prompt: list[int], path: list[int]) -> list[int]:
    """The decoder's greedy pick at each position of `path`, fed `path` itself as it goes.

    Fed as serving feeds it (the prompt in one call, then one cached token per call): with
    dynamically quantized activations a token's logits depend on what shares its call.
    """
    logits, cache = prompt_step(decoder, prompt)
    picks = [int(logits[0, -1].argmax())]
    for token in path[:-1]:
        logits, cache = decoder.step(np.asarray([[token]]), cache)
        picks.append(int(logits[0, -1].argmax()))
    return picks


def token_latency_ms(
    decoder: KVDecoder, prompt: list[int], block_size: int, steps: int = 16
) -> float:
    """Median time of one cached decoding step (one new token), batch 1; never past the
    model's position table."""
    steps = max(1, min(steps, block_size - len(prompt)))
    logits, cache = prompt_step(decoder, prompt)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        logits, cache = decoder.step(np.asarray([[int(logits[0, -1].argmax())]]), cache)
        times.append(1000 * (time.perf_counter() - start))
    return statistics.median(times)


def refusal(report: Report, config: Config) -> str | None:
    """fp32 ONNX against torch (the prompt and cached steps), then int8's perplexity and its
    greedy agreement with fp32."""
    e = config.export
    if why := parity_refusal(report, config, ", prompt and cached steps"):
        return why
    ppl, increase = report["perplexity"], report["perplexity_increase"]
    if increase > e.max_perplexity_increase:
        return (
            f"int8 perplexity {ppl['int8']:.3f} is {100 * increase:.2f}% above fp32 "
            f"{ppl['fp32']:.3f}, more than export.max_perplexity_increase="
            f"{e.max_perplexity_increase}"
        )
    agreement = report["greedy"]["token_agreement"]
    if agreement < e.min_greedy_agreement:
        return (
            f"int8 picks fp32's greedy token at {agreement:.3f} of positions "
            f"({report['greedy']['prompts']} val prompts), below export.min_greedy_agreement="
            f"{e.min_greedy_agreement}"
        )
    return None


EXPORT_PARTS = ExportParts(
    splits=("val",),
    held_out=held_out,
    write_graphs=write_graphs,
    quantize=quantize,
    refusal=refusal,
    programs=programs,
    schema=schema,
    files=files,
    quality=quality,
)
