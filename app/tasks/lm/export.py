"""Export of a causal language model (task `lm`): ONNX with a KV cache, int8 weights, the gate.

One graph serves both phases of generation: `input_ids` [batch, tokens] after a cache of
`past_key_<i>` / `past_value_<i>` per block ([batch, heads, cached, head_dim]; 0 cached for a
prompt) -> `logits` [batch, tokens, vocab] and `present_key_<i>` / `present_value_<i>`, the cache
extended by those tokens. The prompt is fed once and every later token alone (app/runtime/kv.py).

int8 is onnxruntime's dynamic quantization of the weight matrices only (MatMul/Gemm with a
constant weight; attention's activation x activation products stay fp32). The gate compares the
two ONNX variants on held-out data: perplexity on validation sequences (allowed relative
increase `export.max_perplexity_increase`) and greedy-decoding agreement on validation prompts
(`export.min_greedy_agreement`), plus the fp32 graph's parity with torch's `GPT.decode`.
"""

from __future__ import annotations

import io
import logging
import math
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from app.config import Config
from app.data.kinds.tokens import tokens_of
from app.errors import GateError, UserError
from app.export.compile_programs import not_for_task
from app.export.publish import check_onnx_fits, gate_parity_and_size, publish, write_metadata
from app.export.quantize import WEIGHT_BLOCK, quantize_weight_only
from app.models.gpt import GPT, Block, CausalSelfAttention
from app.runtime import artifact as art
from app.runtime.kv import KEY_MASK, POSITIONS, KVDecoder, greedy, past_name, present_name
from app.train.checkpoint import LoadedCheckpoint

log = logging.getLogger(__name__)
WHY_ONNX_ONLY = (
    "language models run ONNX Runtime's KV-cache decode graph, which the decode loop batches"
)
TOKENIZER_FILE = "tokenizer.json"  # the artifact's copy, usable by any `tokenizers` client
LOGITS_BUDGET_BYTES = 64 * 2**20  # per ONNX Runtime call while scoring perplexity


def export_lm(config: Config, loaded: LoadedCheckpoint, checkpoint_uri: str) -> dict[str, Any]:
    """Build, verify and gate the artifact of a language-model checkpoint; publish it."""
    from app.evaluate.held_out import verify_dataset
    from app.registry import run_task

    model = loaded.model
    if not isinstance(model, GPT):
        raise UserError(
            f"{checkpoint_uri}: export of task lm supports model.name gpt (or a gpt2 model.pretrained) only"
        )
    check_onnx_fits(model, checkpoint_uri)
    verify_dataset(config, ("val",))
    rows = validation_rows(config, loaded, config.export.perplexity_rows)
    with tempfile.TemporaryDirectory() as work:
        fp32 = os.path.join(work, art.MODEL_FILES["fp32"])
        int8 = os.path.join(work, art.MODEL_FILES["int8"])
        export_kv_onnx(model, fp32, config.export.opset)
        quantize_weight_only(fp32, int8)
        task = run_task(loaded.config.train.task, loaded.preprocessor.kind).name
        report = {"task": task, **verify_lm(config, model, fp32, int8, rows)}
        gate_lm(report, config)
        Path(work, TOKENIZER_FILE).write_text(tokens_of(loaded.preprocessor).tokenizer.to_str())
        schema = schema_for_lm(model, loaded.preprocessor, task)
        report["programs"] = not_for_task(config, "lm", WHY_ONNX_ONLY)
        write_metadata(work, config, loaded, report, checkpoint_uri, schema)
        uri = publish(work, config.registry, config.artifact_name)
    log.info("export: published %s", uri)
    return {"stage": "export", "artifact": uri, "report": report}


def schema_for_lm(model: GPT, pre: Any, task: str) -> dict[str, Any]:
    """schema.json of a language model: text in, text out, and the graph's cache layout."""
    first = first_attention(model)
    return {
        "kind": pre.kind,
        "task": task,
        "inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [1]}],
        "outputs": [{"name": "text_output", "datatype": "BYTES", "shape": [1]}],
        "labels": [],
        "model_inputs": ["input_ids", *cache_names(len(model.blocks), past_name)],
        "model_outputs": ["logits", *cache_names(len(model.blocks), present_name)],
        "block_size": model.block_size,
        "vocab_size": model.tokens.num_embeddings,
        "layers": len(model.blocks),
        "heads": first.heads,
        "head_dim": first.head_dim,
        "tokenizer": TOKENIZER_FILE,
    }


def first_attention(model: GPT) -> CausalSelfAttention:
    return blocks(model)[0].attn


def blocks(model: GPT) -> list[Block]:
    return [cast(Block, b) for b in model.blocks]


def cache_names(layers: int, name) -> list[str]:
    return [name(kind, i) for i in range(layers) for kind in ("key", "value")]


# --- the graph -----------------------------------------------------------------------------------


class KVCacheGraph(nn.Module):
    """`GPT.decode` written for tracing: the same weights and arithmetic, with every shape taken
    from tensors and the causal mask always explicit. `decode` picks its mask with Python
    branches on the lengths (SDPA's `is_causal` without a cache), which a trace would freeze at
    the example's lengths; parity with `decode` is checked on every export.

    Each row says where its tokens sit (`position_ids` [batch, tokens]) and which cache slots
    hold its keys (`attention_mask` [batch, past + tokens], 1 or 0), so that streams of
    different lengths can share a step: a row's cache is left-padded to the batch's length and
    its padding masked out. The new tokens fill the last slots; a query sees the valid slots up
    to its own."""

    def __init__(self, gpt: GPT):
        super().__init__()
        self.gpt = gpt

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        *past: torch.Tensor,
    ) -> tuple[torch.Tensor, ...]:
        g = self.gpt
        batch, tokens = input_ids.shape
        start = past[0].shape[2]
        query_slots = torch.arange(tokens, device=input_ids.device) + start
        key_slots = torch.arange(start + tokens, device=input_ids.device)
        causal = key_slots.unsqueeze(0) <= query_slots.unsqueeze(1)  # [tokens, slots]
        visible = causal.unsqueeze(0).unsqueeze(0) & (attention_mask[:, None, None, :] > 0)
        x = g.tokens(input_ids) + g.positions(position_ids)
        presents: list[torch.Tensor] = []
        for i, block in enumerate(blocks(g)):
            attn = block.attn
            qkv = attn.qkv(block.norm1(x)).reshape(batch, tokens, 3, attn.heads, attn.head_dim)
            q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
            k = torch.cat([past[2 * i], k], dim=2)
            v = torch.cat([past[2 * i + 1], v], dim=2)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=visible)
            x = x + attn.proj(out.transpose(1, 2).reshape(batch, tokens, -1))
            x = x + block.mlp(block.norm2(x))
            presents += [k, v]
        return (g.head(g.norm(x)), *presents)


def export_kv_onnx(model: GPT, path: str, opset: int) -> None:
    layers = len(model.blocks)
    attn = first_attention(model)
    inputs = ["input_ids", POSITIONS, KEY_MASK, *cache_names(layers, past_name)]
    outputs = ["logits", *cache_names(layers, present_name)]
    # Traced with a cache and a multi-token chunk so that no length is a special case.
    ids = torch.zeros(1, 2, dtype=torch.long)
    positions, mask = torch.tensor([[1, 2]]), torch.ones(1, 3, dtype=torch.long)
    past = [torch.zeros(1, attn.heads, 1, attn.head_dim) for _ in range(2 * layers)]
    dynamic = {"input_ids": {0: "batch", 1: "tokens"}, "logits": {0: "batch", 1: "tokens"}}
    dynamic |= {POSITIONS: {0: "batch", 1: "tokens"}, KEY_MASK: {0: "batch", 1: "total"}}
    dynamic |= {n: {0: "batch", 2: "past"} for n in inputs[3:]}
    dynamic |= {n: {0: "batch", 2: "total"} for n in outputs[1:]}
    buffer = io.BytesIO()
    # The TorchScript exporter writes one self-contained file (the artifact loader refuses
    # external data); GPT-2 small stays far below protobuf's 2 GB. The wrapper is put in eval
    # mode explicitly because the exporter restores its mode afterwards.
    with torch.no_grad():
        torch.onnx.export(
            KVCacheGraph(model).eval(),
            (ids, positions, mask, *past),
            buffer,  # type: ignore[arg-type]  # file-like objects are accepted
            input_names=inputs,
            output_names=outputs,
            dynamic_axes=dynamic,
            opset_version=opset,
            dynamo=False,
            do_constant_folding=True,
        )
    Path(path).write_bytes(buffer.getvalue())


# --- held-out data ------------------------------------------------------------------------------


def validation_rows(config: Config, loaded: LoadedCheckpoint, limit: int) -> np.ndarray:
    """Up to `limit` packed validation rows [n, block + 1], spread evenly over the split."""
    from app.data.prepare import read_manifest, split_files
    from app.tasks.lm.train import token_rows

    manifest = read_manifest(config.data_output)
    rows = np.concatenate(list(token_rows(split_files(config.data_output, manifest, "val"))))
    if not len(rows):
        raise UserError(f"{config.data_output}: the val split is empty; nothing to gate on")
    picked = np.linspace(0, len(rows) - 1, num=min(limit, len(rows))).round().astype(int)
    return rows[np.unique(picked)]


# --- verification -------------------------------------------------------------------------------


def verify_lm(config: Config, model: GPT, fp32: str, int8: str, rows: np.ndarray) -> dict[str, Any]:
    e = config.export
    decoders = {
        v: KVDecoder(art.create_session(Path(p).read_bytes()))
        for v, p in (("fp32", fp32), ("int8", int8))
    }
    parity = decode_parity(model, decoders["fp32"], rows)
    ppl = {v: perplexity(d, rows) for v, d in decoders.items()}
    with torch.no_grad():
        ppl["torch_fp32"] = math.exp(torch_loss(model, rows))
    prompt_len = max(1, min(e.greedy_prompt_tokens, model.block_size - e.greedy_tokens))
    prompts = [row[:prompt_len].tolist() for row in rows[: e.greedy_prompts]]
    agreement = greedy_agreement(decoders, prompts, e.greedy_tokens)
    sizes = {"fp32": os.path.getsize(fp32), "int8": os.path.getsize(int8)}
    log.info(
        "export: perplexity %s greedy agreement %.3f sizes %s parity %.2e",
        ppl,
        agreement["token_agreement"],
        sizes,
        parity["max_abs_diff"],
    )
    return {
        "parity": parity,
        "perplexity": ppl,
        "perplexity_rows": int(len(rows)),
        "perplexity_tokens": int(len(rows) * (rows.shape[1] - 1)),
        "perplexity_increase": ppl["int8"] / ppl["fp32"] - 1,
        "greedy": agreement,
        "size_bytes": sizes,
        "size_ratio_int8": sizes["int8"] / sizes["fp32"],
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
def decode_parity(model: GPT, decoder: KVDecoder, rows: np.ndarray, steps: int = 4) -> dict:
    """ONNX fp32 against torch's `decode`: a prompt (half a row) fed at once, then `steps`
    tokens one at a time on the cache, for up to 4 rows (max abs logit difference)."""
    diffs = []
    half = max(1, min(rows.shape[1] - 1, model.block_size) - steps)
    for row in rows[:4]:
        ids = torch.from_numpy(row[: half + steps]).unsqueeze(0)
        ref, past = model.decode(ids[:, :half])
        got, cache = decoder.step(ids[:, :half].numpy(), decoder.empty_cache())
        diffs.append(np.abs(got - ref.numpy()).max())
        for t in range(half, half + steps):
            ref, past = model.decode(ids[:, t : t + 1], past)
            got, cache = decoder.step(ids[:, t : t + 1].numpy(), cache)
            diffs.append(np.abs(got - ref.numpy()).max())
    return {
        "rows": min(4, len(rows)),
        "prompt_tokens": half,
        "incremental_steps": steps,
        "max_abs_diff": float(max(diffs)),
    }


def perplexity(decoder: KVDecoder, rows: np.ndarray) -> float:
    """exp(mean next-token cross entropy) over every target of `rows`, the prompt path (no
    cache), in slices whose logits stay under LOGITS_BUDGET_BYTES."""
    per_row = 4 * (rows.shape[1] - 1) * decoder.vocab_size
    chunk = max(1, LOGITS_BUDGET_BYTES // per_row)
    total, count = 0.0, 0
    for start in range(0, len(rows), chunk):
        part = rows[start : start + chunk]
        logits, _ = decoder.step(part[:, :-1], decoder.empty_cache(len(part)))
        total += float(cross_entropy_sum(logits, part[:, 1:]))
        count += part[:, 1:].size
    return math.exp(min(total / count, 50.0))


def cross_entropy_sum(logits: np.ndarray, targets: np.ndarray) -> float:
    z = logits.astype(np.float64)
    z -= z.max(axis=-1, keepdims=True)
    log_norm = np.log(np.exp(z).sum(axis=-1))
    picked = np.take_along_axis(z, targets[..., None], axis=-1)[..., 0]
    return float((log_norm - picked).sum())


def torch_loss(model: GPT, rows: np.ndarray) -> float:
    ids = torch.from_numpy(rows)
    logits = model(ids[:, :-1])
    return float(F.cross_entropy(logits.flatten(0, 1).float(), ids[:, 1:].flatten()))


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
    logits, cache = decoder.step(np.asarray([prompt]), decoder.empty_cache())
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
    logits, cache = decoder.step(np.asarray([prompt]), decoder.empty_cache())
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        logits, cache = decoder.step(np.asarray([[int(logits[0, -1].argmax())]]), cache)
        times.append(1000 * (time.perf_counter() - start))
    return statistics.median(times)


def gate_lm(report: dict[str, Any], config: Config) -> None:
    e = config.export
    gate_parity_and_size(report, config, ", prompt and cached steps")
    ppl, increase = report["perplexity"], report["perplexity_increase"]
    if increase > e.max_perplexity_increase:
        raise GateError(
            f"export refused: int8 perplexity {ppl['int8']:.3f} is {100 * increase:.2f}% above "
            f"fp32 {ppl['fp32']:.3f}, more than export.max_perplexity_increase="
            f"{e.max_perplexity_increase}",
            report,
        )
    agreement = report["greedy"]["token_agreement"]
    if agreement < e.min_greedy_agreement:
        raise GateError(
            f"export refused: int8 picks fp32's greedy token at {agreement:.3f} of positions "
            f"({report['greedy']['prompts']} val prompts), below export.min_greedy_agreement="
            f"{e.min_greedy_agreement}",
            report,
        )
