"""An image folder (`data.source: imagefolder`): one subfolder of PNG/JPEG pictures per class,
prepared in pieces (app/data/pieces.py) of at most PICTURES_PER_PIECE pictures of one class.

Planning lists each class folder to count its pictures (it keeps the counts, not the names); a
task lists its folder again and takes its run of the sorted names, decodes each picture (its
header checked against the limits first), resizes it to `data.image_size` and writes it as
its uint8 pixels (a row's bytes), a few hundred at a time. A picture's split is a pure function of (`data.seed`,
its path relative to the root), so adding pictures moves none that were there.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from app.config import Config
from app.data.kinds.image import pixel_column
from app.data.kinds.image_text import BadPicture, PictureLimits
from app.data.pictures import PICTURE_EXTENSIONS, data_limits
from app.data.pieces import PieceResult, ShardWriter, SourcePlan, Target, Tasks, row_keys
from app.errors import UserError

IMAGE_COLUMN = "image"
PICTURES_PER_PIECE = 1000
WRITE_ROWS = 256  # pictures decoded before they are written, a row group each


@dataclass(frozen=True)
class FolderPiece:
    index: int
    root: str
    label: str  # the class folder
    start: int  # a run of its pictures, sorted by name
    stop: int


@dataclass(frozen=True)
class Decode:
    """What a task makes of each picture: `size` x `size` RGB, within `limits`."""

    size: int
    label_column: str
    limits: PictureLimits
    max_examples: int = 5


def planned(config: Config, tasks: Tasks, folder: str) -> SourcePlan:
    cfg = config.data
    root = cfg.path
    if not root or not os.path.isdir(root):
        raise UserError(f"data.path {root!r} does not exist or is not a folder")
    classes = sorted(d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d)))
    if not classes:
        raise UserError(f"{root}: no class subfolders (expected one folder of images per class)")
    pieces: list[FolderPiece] = []
    for label in classes:
        count = len(pictures_in(root, label))
        for start in range(0, count, PICTURES_PER_PIECE):
            stop = min(count, start + PICTURES_PER_PIECE)
            pieces.append(FolderPiece(len(pieces), root, label, start, stop))
    if not pieces:
        raise UserError(f"{root}: no PNG or JPEG images found in {classes}")
    size = cfg.image_size
    decode = Decode(size, cfg.label_column, data_limits(cfg))
    return SourcePlan(
        kind="image",
        features=(IMAGE_COLUMN,),
        label=cfg.label_column,
        schema=schema(cfg.label_column),
        pieces=pieces,
        run=functools.partial(prepare_piece, decode=decode),
        description={"source": "imagefolder", "path": root, "classes": classes, "image_size": size},
        skip_bad_rows=cfg.skip_bad_rows,
        image_shape=(3, size, size),
    )


def schema(label_column: str) -> pa.Schema:
    return pa.schema([(IMAGE_COLUMN, pa.large_binary()), (label_column, pa.string())])


def pictures_in(root: str, label: str) -> list[str]:
    """A class folder's pictures by name, sorted (hidden files left out)."""
    names = os.listdir(os.path.join(root, label))
    return sorted(n for n in names if n.lower().endswith(PICTURE_EXTENSIONS) and n[0] != ".")


def prepare_piece(piece: FolderPiece, target: Target, decode: Decode) -> PieceResult:
    """The piece's pictures decoded, resized and written to their splits' shards."""
    out = PieceResult(piece.index)
    writer = ShardWriter(target, piece.index, schema(decode.label_column))
    names = pictures_in(piece.root, piece.label)[piece.start : piece.stop]
    for first in range(0, len(names), WRITE_ROWS):
        rows, keys, problems = [], [], {}
        for i, name in enumerate(names[first : first + WRITE_ROWS], start=first):
            path = os.path.join(piece.root, piece.label, name)
            pixels, problem = read_picture(path, decode)
            if pixels is None:
                problems[i] = problem or path
                continue
            rows.append(pixels)
            keys.append(f"{piece.label}/{name}")
        out.rows += len(rows) + len(problems)
        out.note_bad(len(problems), problems, decode.max_examples)
        if rows:
            writer.add(_table(rows, piece.label, decode), _keys(keys))
    out.shards = writer.close()
    out.labels = [piece.label] if out.rows > out.bad else []
    return out


def read_picture(path: str, decode: Decode) -> tuple[np.ndarray | None, str | None]:
    """One picture as flat (channels, height, width) uint8, or why it cannot be read.

    Pillow signals a bad file in many ways (UnidentifiedImageError, OSError when truncated,
    ValueError, SyntaxError from some plugins): all of them are the file's fault."""
    from PIL import Image

    size = decode.size
    try:
        with Image.open(path) as img:
            decode.limits.check(*img.size)
            img.draft("RGB", (size, size))  # a JPEG decodes at the smallest scale that covers it
            pixels = np.asarray(img.convert("RGB").resize((size, size)), dtype=np.uint8)
    except BadPicture as e:
        return None, f"{path}: unreadable image ({e})"
    except Exception as e:  # noqa: BLE001 - see above
        detail = (str(e).strip().splitlines() or [""])[0][:120]
        return None, f"{path}: unreadable image ({type(e).__name__}: {detail})"
    return pixels.transpose(2, 0, 1).reshape(-1), None


def _table(rows: list[np.ndarray], label: str, decode: Decode) -> pa.Table:
    pixels = pixel_column(np.stack(rows))
    return pa.table({IMAGE_COLUMN: pixels, decode.label_column: pa.array([label] * len(rows))})


def _keys(paths: list[str]) -> np.ndarray:
    return row_keys(pa.table({"path": pa.array(paths)}), ["path"])
