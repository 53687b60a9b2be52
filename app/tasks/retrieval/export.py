"""Export of a retrieval model: two ONNX graphs (the image encoder and the text encoder, each
to an L2-normalised embedding, the batch free), fp32 and int8, through the gate.

The gate: every fp32 ONNX embedding of `export.parity_rows` val rows has cosine at least
`export.min_cosine` with torch's; int8 loses at most `export.max_recall_drop` points of val
Recall@1 in either direction against fp32 unless that loss is within chance flips (McNemar's
test on each query's outcome under both variants; the same outcome as a classifier's accuracy
gate: exit 3, nothing published). Both graphs' int8 variants hold int8 weights (weight-only): a
row's embedding never depends on its batch mates.
"""

from __future__ import annotations

import functools
import io
import logging
import math
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from app.config import Config
from app.data.kinds.image_text import ImageText, require
from app.errors import GateError
from app.export import quantize as q
from app.export.compile_programs import Subject, build_all, wanted
from app.export.measure import batch_drift
from app.export.publish import check_onnx_fits, publish, write_metadata
from app.runtime import artifact as art
from app.train.checkpoint import LoadedCheckpoint

log = logging.getLogger(__name__)
GRAPHS = {"image": ["pixels"], "text": ["input_ids", "attention_mask"]}
OUTPUT = "embedding"
RECALL_ROWS = 2000  # val rows the int8 recall check embeds at most


class Graph(nn.Module):
    """One tower of a dual encoder as its own graph: inputs -> embedding."""

    def __init__(self, model: Any, graph: str):
        super().__init__()
        self.model, self.graph = model, graph

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        if self.graph == "image":
            return self.model.encode_image(*inputs)
        return self.model.encode_text(*inputs)


def export_retrieval(
    config: Config, loaded: LoadedCheckpoint, checkpoint_uri: str
) -> dict[str, Any]:
    """Both encoders exported, quantized, gated and published as one artifact."""
    from app.evaluate.held_out import verify_dataset

    model, pre = loaded.model.eval(), require(loaded.preprocessor)
    check_onnx_fits(model, checkpoint_uri)
    verify_dataset(config, ("val",))
    sample = sample_rows(config, pre)
    with tempfile.TemporaryDirectory() as work:
        methods = {}
        for graph, names in GRAPHS.items():
            fp32 = os.path.join(work, art.graph_file(graph, "fp32"))
            export_graph(Graph(model, graph), names, sample, fp32, config.export.opset)
            methods[graph] = quantize_graph(graph, fp32, work)
        report = verified(config, model, pre, work, sample)
        report["quantization"] = {"method": methods, "batch_independent": True}
        gate(report, config)
        programs = encoder_programs(config, model, pre, sample, work, report)
        schema = schema_for(pre, loaded)
        write_metadata(work, config, loaded, report, checkpoint_uri, schema, programs)
        uri = publish(work, config.registry, config.artifact_name)
    log.info("export: published %s", uri)
    return {"stage": "export", "artifact": uri, "report": report}


def sample_rows(config: Config, pre: ImageText) -> dict[str, np.ndarray]:
    """The first `export.parity_rows` val rows as model inputs."""
    from app.data.ingest import iter_shards
    from app.data.prepare import read_manifest, split_files

    output = config.data_output
    parts = []
    for frame in iter_shards(split_files(output, read_manifest(output), "val")):
        parts.append(frame)
        if sum(len(p) for p in parts) >= config.export.parity_rows:
            break
    import pandas as pd

    frame = pd.concat(parts).iloc[: config.export.parity_rows]
    return pre.features(pre.raw_features(frame))


def export_graph(
    graph: nn.Module, names: list[str], sample: dict[str, np.ndarray], path: str, opset: int
) -> None:
    args = tuple(torch.from_numpy(sample[n][:2]) for n in names)
    axes = {n: {0: "batch"} for n in [*names, OUTPUT]}
    for name in names:
        if name != "pixels":
            axes[name][1] = "sequence"
    buffer = io.BytesIO()
    torch.onnx.export(
        graph.eval(),
        args,
        buffer,  # type: ignore[arg-type]  # file-like objects are accepted
        input_names=names,
        output_names=[OUTPUT],
        dynamic_axes=axes,
        opset_version=opset,
        dynamo=False,
        do_constant_folding=True,
    )
    Path(path).write_bytes(buffer.getvalue())


def quantize_graph(graph: str, fp32: str, work: str) -> str:
    """int8 of one graph: int8 weights (weight-only), so a row's embedding never depends on its
    batch mates. Static activation scales are not used: calibrated on the val sample, they
    collapsed a convolutional image tower's recall (the gate refused every such export)."""
    q.quantize_weight_only(fp32, os.path.join(work, art.graph_file(graph, "int8")))
    return "weight_only"


def verified(
    config: Config, model: Any, pre: ImageText, work: str, sample: dict[str, np.ndarray]
) -> dict[str, Any]:
    """`verify`'s report; embeddings that are not finite refuse the export (exit 3)."""
    from app.tasks.retrieval.train import NonFiniteEmbeddings

    try:
        return verify(config, model, pre, work, sample)
    except NonFiniteEmbeddings as e:
        raise GateError(f"export refused: {e}", {}) from None


def verify(
    config: Config, model: Any, pre: ImageText, work: str, sample: dict[str, np.ndarray]
) -> dict[str, Any]:
    """Parity of fp32 ONNX with torch (cosine per row), val recall of both variants, sizes and
    latency per graph."""
    from app.tasks.retrieval.evaluate import embed_split, torch_encoders
    from app.tasks.retrieval.train import certain_hits, recall

    sessions = {
        variant: {
            g: art.create_session(Path(work, art.graph_file(g, variant)).read_bytes())
            for g in GRAPHS
        }
        for variant in art.VARIANTS
    }
    torch_image, torch_text = torch_encoders(model)
    cosine = {
        "image": min_cosine(
            torch_image(pick(sample, "image")),
            run(sessions["fp32"]["image"], pick(sample, "image")),
        ),
        "text": min_cosine(
            torch_text(pick(sample, "text")), run(sessions["fp32"]["text"], pick(sample, "text"))
        ),
    }
    recalls, hits = {}, {}
    for variant, graph_sessions in sessions.items():
        encoders = (
            lambda x, s=graph_sessions["image"]: run(s, x),
            lambda x, s=graph_sessions["text"]: run(s, x),
        )
        rows = embed_split(config, pre, "val", encoders, max_rows=RECALL_ROWS)
        recalls[variant] = recall(rows.images, rows.texts, rows.groups)
        hits[variant] = certain_hits(rows.images, rows.texts, rows.groups)
    return {
        "parity": {"min_cosine": cosine, "rows": len(sample["pixels"])},
        "recall": recalls,
        "recall_drop": {
            d: recalls["fp32"][f"{d}_r1"] - recalls["int8"][f"{d}_r1"] for d in ("i2t", "t2i")
        },
        # Per direction, queries int8 lost (found first by fp32 only) and gained.
        "recall_changes": {
            d: {
                "lost": int((hits["fp32"][d] & ~hits["int8"][d]).sum()),
                "gained": int((~hits["fp32"][d] & hits["int8"][d]).sum()),
            }
            for d in ("i2t", "t2i")
        },
        "size_bytes": {
            v: sum(os.path.getsize(os.path.join(work, art.graph_file(g, v))) for g in GRAPHS)
            for v in art.VARIANTS
        },
        "latency_ms": {
            v: {
                g: latency(sessions[v][g], pick(sample, g), config.export.latency_repeats)
                for g in GRAPHS
            }
            for v in art.VARIANTS
        },
    }


def encoder_programs(
    config: Config,
    model: Any,
    pre: ImageText,
    sample: dict[str, np.ndarray],
    work: str,
    report: dict[str, Any],
) -> dict[str, Any]:
    """Both encoders as programs (`export.formats`: `image.pt2` and `text.pt2`, `image.pte`,
    ...), each variant checked as the ONNX ones are: fp32 embeddings' cosine with torch's,
    int8's val recall against ONNX fp32's, every row's embedding alone as in a batch. A variant
    is published with both its graphs or not at all."""
    report["programs"] = {}
    if not wanted(config):
        return {}
    subjects = {}
    for graph, names in GRAPHS.items():
        rows = pick(sample, graph)
        batches = [
            {k: v[s : s + 32] for k, v in rows.items()} for s in range(0, len(rows[names[0]]), 32)
        ]
        subjects[graph] = Subject(
            Graph(model, graph).eval(),
            names,
            [n for n in names if n != "pixels"],
            rows,
            functools.partial(list, batches),  # int8's static scales: the val sample
        )
    return build_all(config, subjects, EncoderCheck(config, model, pre, sample, work), work, report)


class EncoderCheck:
    """A variant's two encoder programs by the retrieval gate's rules."""

    def __init__(self, config: Config, model: Any, pre: ImageText, sample, work: str):
        from app.tasks.retrieval.evaluate import torch_encoders

        self.config, self.pre, self.sample = config, pre, sample
        encode = dict(zip(GRAPHS, torch_encoders(model), strict=True))
        self.torch = {g: encode[g](pick(sample, g)) for g in GRAPHS}
        onnx = {
            g: art.create_session(Path(work, art.graph_file(g, "fp32")).read_bytes())
            for g in GRAPHS
        }
        self.fp32_recall, self.fp32_hits = self.recall(onnx)

    def recall(self, sessions: dict[str, Any]) -> tuple[dict[str, float], dict[str, np.ndarray]]:
        from app.tasks.retrieval.evaluate import embed_split
        from app.tasks.retrieval.train import certain_hits, recall

        encoders = (
            lambda x: run(sessions["image"], x),
            lambda x: run(sessions["text"], x),
        )
        rows = embed_split(self.config, self.pre, "val", encoders, max_rows=RECALL_ROWS)
        return recall(rows.images, rows.texts, rows.groups), certain_hits(
            rows.images, rows.texts, rows.groups
        )

    def __call__(self, variant: str, sessions: dict[str, Any]) -> tuple[dict[str, Any], str | None]:
        e = self.config.export
        recalls, hits = self.recall(sessions)
        m = {
            "min_cosine": {
                g: min_cosine(self.torch[g], run(sessions[g], pick(self.sample, g))) for g in GRAPHS
            },
            "recall": recalls,
            "batch_drift": max(batch_drift(sessions[g], pick(self.sample, g)) for g in GRAPHS),
            "latency_ms": {
                g: latency(sessions[g], pick(self.sample, g), e.latency_repeats) for g in GRAPHS
            },
        }
        return m, self.refusal(variant, m, hits)

    def refusal(self, variant: str, m: dict[str, Any], hits: dict[str, np.ndarray]) -> str | None:
        from app.export.compile_programs import PRECISION, drift_refusal

        e = self.config.export
        for graph, cosine in m["min_cosine"].items():
            if PRECISION[variant] == "fp32" and not cosine >= e.min_cosine:
                return f"the {graph} encoder reaches cosine {cosine:.5f} with torch, below export.min_cosine={e.min_cosine}"
        if why := drift_refusal(m["batch_drift"], e.parity_tolerance):
            return why
        for d in ("i2t", "t2i"):
            drop = self.fp32_recall[f"{d}_r1"] - m["recall"][f"{d}_r1"]
            lost = int((self.fp32_hits[d] & ~hits[d]).sum())
            gained = int((~self.fp32_hits[d] & hits[d]).sum())
            if drop > e.max_recall_drop and significant(lost, gained):
                return (
                    f"loses {drop:.2f} points of val {d} R@1 against ONNX fp32 ({lost} queries "
                    f"lost, {gained} gained), more than export.max_recall_drop={e.max_recall_drop:g}"
                )
        return None


def pick(sample: dict[str, np.ndarray], graph: str) -> dict[str, np.ndarray]:
    return {n: sample[n] for n in GRAPHS[graph]}


def run(session: Any, inputs: dict[str, np.ndarray]) -> np.ndarray:
    return session.run([OUTPUT], inputs)[0]


def min_cosine(expected: np.ndarray, actual: np.ndarray) -> float:
    """The worst row's cosine; a row with a NaN or infinite value on either side counts as
    -1, the worst there is (a NaN would pass every `<` comparison a gate makes)."""
    dot = (expected * actual).sum(1)
    norms = np.linalg.norm(expected, axis=1) * np.linalg.norm(actual, axis=1)
    cosine = dot / np.maximum(norms, 1e-12)
    return float(np.where(np.isfinite(cosine), cosine, -1.0).min())


def latency(session: Any, sample: dict[str, np.ndarray], repeats: int) -> dict[str, float]:
    out = {}
    for batch in (1, 32):
        inputs = {k: np.resize(v, (batch, *v.shape[1:])) for k, v in sample.items()}
        run(session, inputs)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            run(session, inputs)
            times.append(1000 * (time.perf_counter() - start))
        out[f"batch_{batch}"] = statistics.median(times)
    return out


def gate(report: dict[str, Any], config: Config) -> None:
    e = config.export
    for graph, cosine in report["parity"]["min_cosine"].items():
        if not cosine >= e.min_cosine:
            raise GateError(
                f"export refused: the fp32 ONNX {graph} encoder's embeddings reach cosine "
                f"{cosine:.5f} with torch's, below export.min_cosine={e.min_cosine}",
                report,
            )
    for direction, drop in report["recall_drop"].items():
        changes = report["recall_changes"][direction]
        if drop > e.max_recall_drop and significant(changes["lost"], changes["gained"]):
            raise GateError(
                f"export refused: int8 loses {drop:.2f} points of val {direction} R@1 against "
                f"fp32 ({changes['lost']} queries lost, {changes['gained']} gained), more than "
                f"export.max_recall_drop={e.max_recall_drop:g}; nothing was published",
                report,
            )


def significant(lost: int, gained: int, z: float = 1.96) -> bool:
    """Whether int8 losing `lost` queries fp32 found first and gaining `gained` is more than
    chance flips between near-tied candidates (McNemar's test on the paired outcomes, one
    side at 97.5%). On a small val split two lost pictures are no evidence; on a large one a
    drop over export.max_recall_drop always is."""
    return lost - gained > z * math.sqrt(lost + gained)


def schema_for(pre: ImageText, loaded: LoadedCheckpoint) -> dict[str, Any]:
    from app.registry import run_task

    task = run_task(loaded.config.train.task, pre.kind).name
    model: Any = loaded.model
    width = int(model.image_proj.out_features)
    return {
        "task": task,
        "kind": pre.kind,
        "graphs": {g: {"inputs": names, "output": OUTPUT} for g, names in GRAPHS.items()},
        "inputs": pre.raw_inputs(),
        "outputs": [{"name": OUTPUT, "datatype": "FP32", "shape": [-1, width]}],
        "embed_dim": width,
        "feature_columns": pre.feature_columns[:2],
    }
