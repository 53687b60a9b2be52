"""Task `retrieval`: Recall@K both ways on a held-out split, every caption of a picture counted;
the split embedded by any pair of encoders (torch here, ONNX Runtime at export)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from app import storage
from app.config import Config
from app.data.ingest import iter_shards
from app.data.prepare import read_manifest, split_files
from app.data.preprocess import Preprocessor
from app.evaluate.held_out import EVALUATION_FILE
from app.train.checkpoint import LoadedCheckpoint

log = logging.getLogger(__name__)


RECALL_PNG = "recall_at_k.png"


def evaluate_retrieval(
    config: Config, checkpoint_uri: str, loaded: LoadedCheckpoint, split: str
) -> dict[str, Any]:
    """Task `retrieval`: Recall@1/5/10 both ways with every caption of a picture counted, their
    sum, chance, the binding subset's score where the data has one, and recall against K."""
    from app import plots
    from app.tasks.retrieval.train import chance, recall

    model = loaded.model.eval()
    split_rows = embed_split(config, loaded.preprocessor, split, torch_encoders(model))
    metrics: dict[str, Any] = recall(split_rows.images, split_rows.texts, split_rows.groups)
    pictures = len(np.unique(split_rows.groups))
    metrics |= {"chance_r1": chance(pictures, len(split_rows.texts)), "pictures": pictures}
    metrics |= {"captions": len(split_rows.texts), "split": split}
    if (binding := split_rows.binding()) is not None:
        metrics["binding_accuracy"] = binding
    storage.write_json(storage.join(checkpoint_uri, EVALUATION_FILE), metrics)
    curve = recall_at_k(split_rows, 10)
    png = storage.join(checkpoint_uri, RECALL_PNG)
    storage.write_bytes(png, plots.recall_curve(curve, f"{split} split: recall against K"))
    log.info(
        "evaluate: i2t R@1 %.1f t2i R@1 %.1f rsum %.1f (chance R@1 %.2f) on %d %s pictures",
        metrics["i2t_r1"],
        metrics["t2i_r1"],
        metrics["rsum"],
        metrics["chance_r1"],
        pictures,
        split,
    )
    return {
        "stage": "evaluate",
        "checkpoint": checkpoint_uri,
        "metrics": metrics,
        "plots": {"recall": png},
    }


Encoders = tuple[
    Callable[[dict[str, np.ndarray]], np.ndarray], Callable[[dict[str, np.ndarray]], np.ndarray]
]


@dataclass
class SplitEmbeddings:
    """A split's rows embedded: a picture's embedding on each of its captions' rows."""

    images: np.ndarray
    texts: np.ndarray
    groups: np.ndarray
    twins: np.ndarray  # the twin picture's group number, -1 for none

    def binding(self) -> float | None:
        """Of the captions of pictures with a twin (the same objects, two colours swapped):
        the share closer to their own picture than to its twin (%)."""
        has = self.twins >= 0
        if not has.any():
            return None
        first = {g: i for i, g in reversed(list(enumerate(self.groups)))}
        twin_rows = np.asarray([first.get(t, -1) for t in self.twins[has]])
        known = twin_rows >= 0
        texts, own = self.texts[has][known], self.images[has][known]
        other = self.images[twin_rows[known]]
        return 100.0 * float(np.mean((texts * own).sum(1) > (texts * other).sum(1)))


def embed_split(
    config: Config,
    pre: Preprocessor,
    split: str,
    encoders: Encoders,
    max_rows: int | None = None,
    batch_rows: int = 256,
) -> SplitEmbeddings:
    """Every row of a split (the first `max_rows`) through `encoders` (image inputs -> image
    embeddings, text inputs -> text embeddings), shard by shard on the driver."""
    from app.data.kinds.image_text import GROUP_KEY, group_number

    encode_image, encode_text = encoders
    output = config.data_output
    parts: dict[str, list[np.ndarray]] = {"images": [], "texts": [], "groups": [], "twins": []}
    taken = 0
    for frame in iter_shards(split_files(output, read_manifest(output), split)):
        for start in range(0, len(frame), batch_rows):
            part = frame.iloc[start : start + batch_rows]
            if max_rows is not None:
                part = part.iloc[: max_rows - taken]
            batch = pre.transform_batch({c: part[c].to_numpy() for c in part.columns})
            parts["images"].append(encode_image({"pixels": batch["pixels"]}))
            texts = {k: batch[k] for k in ("input_ids", "attention_mask")}
            parts["texts"].append(encode_text(texts))
            parts["groups"].append(batch[GROUP_KEY])
            twins = part["twin"] if "twin" in part else [""] * len(part)
            parts["twins"].append(np.asarray([group_number(t) if t else -1 for t in twins]))
            taken += len(part)
            if max_rows is not None and taken >= max_rows:
                break
        if max_rows is not None and taken >= max_rows:
            break
    return SplitEmbeddings(**{k: np.concatenate(v) for k, v in parts.items()})


def torch_encoders(model: Any) -> Encoders:
    @torch.no_grad()
    def image(inputs: dict[str, np.ndarray]) -> np.ndarray:
        return model.encode_image(torch.from_numpy(inputs["pixels"])).float().numpy()

    @torch.no_grad()
    def text(inputs: dict[str, np.ndarray]) -> np.ndarray:
        tensors = {k: torch.from_numpy(v) for k, v in inputs.items()}
        return model.encode_text(**tensors).float().numpy()

    return image, text


def recall_at_k(rows: SplitEmbeddings, top: int) -> dict[str, list[float]]:
    from app.tasks.retrieval.train import recall

    metrics = recall(rows.images, rows.texts, rows.groups, tuple(range(1, top + 1)))
    return {
        "image -> text": [metrics[f"i2t_r{k}"] for k in range(1, top + 1)],
        "text -> image": [metrics[f"t2i_r{k}"] for k in range(1, top + 1)],
    }
