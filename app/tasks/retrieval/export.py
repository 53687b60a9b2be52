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
import logging
import math
import os
from typing import Any

import numpy as np
import torch
from torch import nn

from app.config import Config
from app.data.kinds.image_text import ImageText, require
from app.errors import GateError
from app.export import quantize as q
from app.export.compile_programs import Subject, build_all, wanted
from app.export.exporter import ExportParts, Quality, Report, sizes
from app.export.measure import batch_drift, latency_ms
from app.export.onnx_graph import batch_axes, write_onnx
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


def held_out(config: Config, loaded: LoadedCheckpoint) -> dict[str, np.ndarray]:
    return sample_rows(config, require(loaded.preprocessor))


def write_graphs(
    config: Config, loaded: LoadedCheckpoint, sample: dict[str, np.ndarray], work: str
) -> None:
    for graph, names in GRAPHS.items():
        path = os.path.join(work, art.graph_file(graph, "fp32"))
        export_graph(Graph(loaded.model.eval(), graph), names, sample, path, config.export.opset)


def quantize(
    config: Config, loaded: LoadedCheckpoint, sample: dict[str, np.ndarray], work: str
) -> Report:
    """Both graphs' int8 (`quantize_graph`), then both variants measured (`verified`)."""
    methods = {graph: quantize_graph(graph, work) for graph in GRAPHS}
    report = verified(config, loaded.model.eval(), require(loaded.preprocessor), work, sample)
    report["quantization"] = {"method": methods, "batch_independent": True}
    return report


def programs(
    config: Config,
    loaded: LoadedCheckpoint,
    sample: dict[str, np.ndarray],
    work: str,
    report: Report,
) -> dict[str, Any]:
    return encoder_programs(
        config, loaded.model, require(loaded.preprocessor), sample, work, report
    )


def files(loaded: LoadedCheckpoint) -> dict[str, bytes]:
    return {}  # the tokenizer and image processor travel in preprocessor.json


def quality(report: Report) -> Quality:
    """Val R@1, the mean of both directions."""
    recall = report["recall"]

    def r1(values: dict[str, float]) -> float:
        return (values["i2t_r1"] + values["t2i_r1"]) / 2

    latency = {
        v: {f"{g} {b.replace('_', ' ')}": ms for g, by in graphs.items() for b, ms in by.items()}
        for v, graphs in report["latency_ms"].items()
    }
    return Quality(
        metric="val R@1 (%), mean of both directions",
        key="recall_at_1",
        values={"onnx_fp32": r1(recall["fp32"]), "onnx_int8": r1(recall["int8"])},
        higher_is_better=True,
        latency_ms=latency,
    )


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
    args = [torch.from_numpy(sample[n][:2]) for n in names]
    axes = batch_axes([*names, OUTPUT], [n for n in names if n != "pixels"])
    write_onnx(graph, args, path, names, [OUTPUT], axes, opset)


def quantize_graph(graph: str, work: str) -> str:
    """int8 of one graph: int8 weights (weight-only), so a row's embedding never depends on its
    batch mates. Static activation scales are not used: calibrated on the val sample, they
    collapsed a convolutional image tower's recall (the gate refused every such export)."""
    fp32, int8 = (os.path.join(work, art.graph_file(graph, v)) for v in ("fp32", "int8"))
    q.quantize_weight_only(fp32, int8)
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
            g: art.create_session(art.local_graph(os.path.join(work, art.graph_file(g, variant))))
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
        **sizes(work, {v: [art.graph_file(g, v) for g in GRAPHS] for v in art.VARIANTS}),
        "latency_ms": {
            v: {
                g: latency_ms(
                    sessions[v][g], pick(sample, g), config.export.latency_repeats, OUTPUT
                )
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
            g: art.create_session(art.local_graph(os.path.join(work, art.graph_file(g, "fp32"))))
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
            "batch_drift": max(
                batch_drift(sessions[g], pick(self.sample, g), output=OUTPUT) for g in GRAPHS
            ),
            "latency_ms": {
                g: latency_ms(sessions[g], pick(self.sample, g), e.latency_repeats, OUTPUT)
                for g in GRAPHS
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


def refusal(report: Report, config: Config) -> str | None:
    """fp32 ONNX embeddings against torch's (cosine, per graph), then int8's val recall against
    fp32's (a drop beyond chance flips)."""
    e = config.export
    for graph, cosine in report["parity"]["min_cosine"].items():
        if not cosine >= e.min_cosine:
            return (
                f"the fp32 ONNX {graph} encoder's embeddings reach cosine {cosine:.5f} with "
                f"torch's, below export.min_cosine={e.min_cosine}"
            )
    for direction, drop in report["recall_drop"].items():
        changes = report["recall_changes"][direction]
        if drop > e.max_recall_drop and significant(changes["lost"], changes["gained"]):
            return (
                f"int8 loses {drop:.2f} points of val {direction} R@1 against fp32 "
                f"({changes['lost']} queries lost, {changes['gained']} gained), more than "
                f"export.max_recall_drop={e.max_recall_drop:g}; nothing was published"
            )
    return None


def significant(lost: int, gained: int, z: float = 1.96) -> bool:
    """Whether int8 losing `lost` queries fp32 found first and gaining `gained` is more than
    chance flips between near-tied candidates (McNemar's test on the paired outcomes, one
    side at 97.5%). On a small val split two lost pictures are no evidence; on a large one a
    drop over export.max_recall_drop always is."""
    return lost - gained > z * math.sqrt(lost + gained)


def schema(loaded: LoadedCheckpoint, task: str) -> dict[str, Any]:
    pre = require(loaded.preprocessor)
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
