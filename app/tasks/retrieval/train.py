"""Task `retrieval`'s math: the symmetric InfoNCE loss over every worker's batch, and Recall@K
both ways with every caption of a picture counted as that picture's.

The loss (OpenCLIP's `ClipLoss` with local loss): each rank scores its own pictures against the
captions of every rank's batch, and its captions against every rank's pictures; the embeddings
are gathered with their gradients (torch's functional `all_gather_single_autograd`), so the
averaged gradients equal one process's on the whole batch. Rows of the same picture in a batch
are not each other's negatives.

Recall (the COCO / Flickr30k protocol): text -> image counts a hit when a caption's picture is
among the K most similar pictures (each picture once); image -> text when any of the picture's
captions is among its K most similar captions. Ties count at their expected place (a query
tied with t others scores the chance that random order puts its match within K), so a collapsed
encoder scores chance; NaN or infinite embeddings are refused (`NonFiniteEmbeddings`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from app.data.feed import unpadded
from app.data.kinds.image_text import GROUP_KEY
from app.errors import UserError
from app.train.steps import autocast

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
        # torch's functional collectives: their all-gather carries gradients back to each
        # rank's rows (torch.distributed.nn.functional's, which did so, is deprecated).
        from torch.distributed import _functional_collectives as funcol

        gathered = funcol.all_gather_single_autograd(padded, 0, list(range(world)))
        parts = list(funcol.wait_tensor(gathered).chunk(world))
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


class NonFiniteEmbeddings(UserError):
    """An encoder produced NaN or infinite embeddings: no ranking of them means anything."""


def hit_chances(
    images: np.ndarray, texts: np.ndarray, groups: np.ndarray, k: int
) -> dict[str, np.ndarray]:
    """Each query's chance (0 to 1) of finding its match among the top `k` of row-aligned
    image and text embeddings (a picture's embedding on each of its captions' rows), ties
    broken at random: `i2t` a picture finds any of its captions among every caption (pictures
    counted once by `groups`), `t2i` a caption finds its picture. Ties count at their expected
    place, so an encoder that maps everything to one point scores chance, not 100."""
    return standings(images, texts, groups).chances(k)


@dataclass(frozen=True)
class Standings:
    """Per query: how many candidates score above its match, and how many tie with it."""

    t2i_above: np.ndarray
    t2i_tied: np.ndarray  # its own picture among them
    i2t_above: np.ndarray
    i2t_others: np.ndarray  # other pictures' captions tied with its best caption
    i2t_own: np.ndarray  # its own captions at that best score

    def chances(self, k: int) -> dict[str, np.ndarray]:
        return {
            "i2t": first_among(self.i2t_above, self.i2t_others, self.i2t_own, k),
            "t2i": np.clip((k - self.t2i_above) / self.t2i_tied, 0.0, 1.0),
        }


def standings(images: np.ndarray, texts: np.ndarray, groups: np.ndarray) -> Standings:
    for name, x in (("image", images), ("text", texts)):
        if not np.isfinite(x).all():
            bad = int((~np.isfinite(x).all(axis=tuple(range(1, x.ndim)))).sum())
            raise NonFiniteEmbeddings(
                f"{bad} of {len(x)} {name} embeddings are not finite (NaN or infinite): the "
                "encoder is broken"
            )
    pictures, first, of_caption = np.unique(groups, return_index=True, return_inverse=True)
    similar = texts @ images[first].T  # [captions, pictures]
    own = similar[np.arange(len(texts)), of_caption][:, None]
    mine = of_caption[None, :] == np.arange(len(pictures))[:, None]  # [pictures, captions]
    scores = similar.T
    best = np.where(mine, scores, -np.inf).max(1, keepdims=True)
    others = np.where(mine, -np.inf, scores)
    return Standings(
        (similar > own).sum(1),
        (similar == own).sum(1),
        (others > best).sum(1),
        (others == best).sum(1),
        (mine & (scores == best)).sum(1),
    )


def first_among(above: np.ndarray, others: np.ndarray, own: np.ndarray, k: int) -> np.ndarray:
    """The chance that one of `own` tied items comes within the top `k`, when `above` items
    score higher and `others` tie with them, the tied block in random order."""
    room = k - above  # places left in the top k for the tied block
    miss = np.where(room > 0, 1.0, 0.0)
    for j in range(k):  # every place taken by another tied item: (t/(t+m)) * ((t-1)/(t+m-1))...
        step = j < room
        ratio = np.where(others - j > 0, (others - j) / np.maximum(others + own - j, 1), 0.0)
        miss = np.where(step, miss * ratio, miss)
    return np.where(room > 0, 1.0 - miss, 0.0)


def certain_hits(
    images: np.ndarray, texts: np.ndarray, groups: np.ndarray
) -> dict[str, np.ndarray]:
    """The queries whose match is surely first (no tie shares first place): what int8 lost
    or gained against fp32 is counted on these."""
    return {d: p >= 1.0 for d, p in hit_chances(images, texts, groups, 1).items()}


def recall(
    images: np.ndarray, texts: np.ndarray, groups: np.ndarray, ks: tuple[int, ...] = KS
) -> dict[str, float]:
    """Recall@K (in %) both ways (`hit_chances`), and their sum (`rsum`)."""
    out: dict[str, float] = {}
    standing = standings(images, texts, groups)
    for k in ks:
        chances = standing.chances(k)
        out[f"i2t_r{k}"] = 100.0 * float(np.mean(chances["i2t"]))
        out[f"t2i_r{k}"] = 100.0 * float(np.mean(chances["t2i"]))
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
