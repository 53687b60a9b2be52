"""Task `retrieval`'s math: the symmetric InfoNCE loss over every worker's batch, and Recall@K
both ways with every caption of a picture counted as that picture's.

The loss (OpenCLIP's `ClipLoss` with local loss): each rank scores its own pictures against the
captions of every rank's batch, and its captions against every rank's pictures; the embeddings
are gathered with their gradients (`torch.distributed.nn.functional.all_gather`), so the
averaged gradients equal one process's on the whole batch. Rows of the same picture in a batch
are not each other's negatives.

Recall (the COCO / Flickr30k protocol): text -> image counts a hit when a caption's picture is
among the K most similar pictures (each picture once); image -> text when any of the picture's
captions is among its K most similar captions.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from app.data.feed import unpadded
from app.data.kinds.image_text import GROUP_KEY
from app.tasks.steps import autocast

KS = (1, 5, 10)
INPUTS = ("pixels", "input_ids", "attention_mask")


def contrastive_loss(
    model: nn.Module, batch: dict[str, torch.Tensor], device: torch.device
) -> tuple[torch.Tensor, int]:
    """Mean of the image->text and text->image cross entropies of the batch's rows against
    every rank's rows; and the rows."""
    images, texts, scale = model(**{k: batch[k].to(device) for k in INPUTS})
    groups = batch[GROUP_KEY].to(device)
    return pair_loss(images, texts, scale, groups), len(images)


def pair_loss(
    images: torch.Tensor, texts: torch.Tensor, scale: torch.Tensor, groups: torch.Tensor
) -> torch.Tensor:
    all_images, offset = gather_rows(images)
    all_texts, _ = gather_rows(texts)
    all_groups, _ = gather_rows(groups, grad=False)
    targets = offset + torch.arange(len(images), device=images.device)
    # Another row of the same picture is not a negative: out of the softmax.
    same = (groups[:, None] == all_groups[None, :]) & (
        targets[:, None] != torch.arange(len(all_groups), device=images.device)[None, :]
    )
    lowest = torch.finfo(images.dtype).min
    per_image = (scale * images @ all_texts.T).masked_fill(same, lowest)
    per_text = (scale * texts @ all_images.T).masked_fill(same, lowest)
    return (F.cross_entropy(per_image, targets) + F.cross_entropy(per_text, targets)) / 2


def gather_rows(x: torch.Tensor, grad: bool = True) -> tuple[torch.Tensor, int]:
    """Every rank's rows in rank order (with their gradients when `grad`), and where this
    rank's start. Ranks may hold different numbers of rows."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return x, 0
    world, rank = dist.get_world_size(), dist.get_rank()
    counts = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(counts, torch.tensor([len(x)], dtype=torch.int64))
    sizes = [int(c) for c in counts]
    padded = F.pad(x, (0, 0) * (x.dim() - 1) + (0, max(sizes) - len(x)))
    if grad:
        from torch.distributed.nn.functional import all_gather

        parts = list(all_gather(padded))
    else:
        parts = [torch.empty_like(padded) for _ in range(world)]
        dist.all_gather(parts, padded)
    return torch.cat([p[:n] for p, n in zip(parts, sizes, strict=True)]), sum(sizes[:rank])


@torch.no_grad()
def validate_retrieval(
    model: nn.Module,
    batches: Iterable[dict[str, torch.Tensor]],
    device: torch.device,
    precision: str,
    reference: dict[str, float] | None = None,
) -> dict[str, float]:
    """Recall@1/5/10 both ways and their sum over the whole val split (every rank's rows
    gathered, so every rank reports the same), and the contrastive loss of its batches."""
    model.eval()
    images, texts, groups, loss_sum, rows = [], [], [], 0.0, 0
    for batch in batches:
        batch, padding = unpadded(batch)
        with autocast(device, precision):
            img, txt, scale = model(**{k: batch[k].to(device) for k in INPUTS})
        img, txt, group = img.float(), txt.float(), batch[GROUP_KEY].to(device)
        if padding:  # the other ranks' forward pass and loss gathers, with no rows to count
            pair_loss(img[:0], txt[:0], scale.float(), group[:0])
            continue
        loss_sum += float(pair_loss(img, txt, scale.float(), group)) * len(img)
        rows += len(img)
        images.append(img)
        texts.append(txt)
        groups.append(group)
    all_images, _ = gather_rows(_cat(images), grad=False)
    all_texts, _ = gather_rows(_cat(texts), grad=False)
    all_groups, _ = gather_rows(_cat(groups, torch.int64), grad=False)
    totals = torch.tensor([loss_sum, float(rows)], dtype=torch.float64)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(totals)
    metrics = recall(all_images.cpu().numpy(), all_texts.cpu().numpy(), all_groups.cpu().numpy())
    out = {f"val_{k}": v for k, v in metrics.items()}
    return out | {"val_loss": float(totals[0]) / max(float(totals[1]), 1.0)}


def _cat(parts: list[torch.Tensor], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    if parts:
        return torch.cat(parts)
    return torch.zeros((0,) if dtype == torch.int64 else (0, 1), dtype=dtype)


def ranks(images: np.ndarray, texts: np.ndarray, groups: np.ndarray) -> dict[str, np.ndarray]:
    """Each query's rank (0: found first) of row-aligned image and text embeddings (a
    picture's embedding on each of its captions' rows): `i2t` a picture's best-ranked caption
    among every caption (pictures counted once by `groups`), `t2i` a caption's picture."""
    pictures, first, of_caption = np.unique(groups, return_index=True, return_inverse=True)
    similar = texts @ images[first].T  # [captions, pictures]
    own = similar[np.arange(len(texts)), of_caption]
    order = np.argsort(-similar.T, axis=1, kind="stable")
    return {
        "i2t": np.argmax(of_caption[order] == np.arange(len(pictures))[:, None], axis=1),
        "t2i": (similar > own[:, None]).sum(1),
    }


def recall(
    images: np.ndarray, texts: np.ndarray, groups: np.ndarray, ks: tuple[int, ...] = KS
) -> dict[str, float]:
    """Recall@K (in %) both ways (`ranks`), and their sum (`rsum`)."""
    by = ranks(images, texts, groups)
    out: dict[str, float] = {}
    for k in ks:
        out[f"i2t_r{k}"] = 100.0 * float(np.mean(by["i2t"] < k))
        out[f"t2i_r{k}"] = 100.0 * float(np.mean(by["t2i"] < k))
    out["rsum"] = sum(out.values())
    return out


def chance(pictures: int, captions: int) -> float:
    """Recall@1 (in %) of a model that ranks at random: one picture in all of them."""
    return 100.0 / max(pictures, 1)


def headline(metrics: dict[str, Any]) -> str:
    return (
        f"val_rsum {metrics['val_rsum']:.1f} i2t_r1 {metrics['val_i2t_r1']:.1f} "
        f"t2i_r1 {metrics['val_t2i_r1']:.1f}"
    )
