"""Image-caption pairs for retrieval: where a table's pictures may be read from and how they are
checked (a table or a Karpathy JSON is prepared in pieces by app/data/image_text_source.py), and
generated scenes every machine can make.

Each row is one caption of one picture; rows of the same picture share its `image_id` (and a
generated picture and its twin share a group), so the split never puts a picture in two splits.
Shards keep the picture's encoded bytes (PNG or JPEG, as the source has them) and the raw
caption: decoding and resizing belong to the fitted preprocessor (app/data/kinds/image_text.py).
A picture that cannot be read (missing, corrupt, a decompression bomb) is refused with one line
naming its row, or skipped and counted when `data.skip_bad_rows` is set.
"""

from __future__ import annotations

import io
import os
import posixpath
import stat
from collections.abc import Iterator
from typing import Any

import numpy as np
import pandas as pd

from app import storage
from app.config import DataConfig
from app.data.kinds.image_text import MAX_PIXELS, BadPicture, PictureLimits
from app.data.reasons import shown

PICTURE_EXTENSIONS = (".png", ".jpg", ".jpeg")  # what a folder of pictures is read for
IMAGE, CAPTION, IMAGE_ID, TWIN, SPLIT = "image", "caption", "image_id", "twin", "split"
RESERVED = (IMAGE, CAPTION, IMAGE_ID, TWIN, SPLIT)  # the columns prepare writes itself
KARPATHY_SPLITS = {"train": "train", "restval": "train", "val": "val", "test": "test"}


def check_picture(data: bytes, limits: PictureLimits = PictureLimits()) -> str | None:
    """Why these bytes are not a picture PIL can decode within `limits`, or None: decoded
    whole (a truncated file fails), not converted (the shards keep the bytes)."""
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as img:
            limits.check(*img.size)
            img.load()
    except BadPicture as e:
        return str(e)
    except Exception as e:  # noqa: BLE001 - PIL signals a bad file in many ways
        detail = (str(e).strip().splitlines() or [""])[0][:80]
        return f"not a picture ({type(e).__name__}: {detail})"
    return None


def data_limits(cfg: DataConfig) -> PictureLimits:
    return PictureLimits(MAX_PIXELS, cfg.max_image_aspect, None, aspect_key="data.max_image_aspect")


class PictureReader:
    """Reads the pictures a table names, only where they may be: a relative path under `base`
    (the table's folder), an absolute path or a URI under one of `data.image_roots`; only
    regular files, at most `data.max_image_bytes` each. A path outside, a missing file and a
    device get the same refusal, so a table cannot probe what exists elsewhere."""

    def __init__(self, base: str, cfg: DataConfig, decoded_after: bool = False):
        self.base = base
        self.roots = [_normal(r) for r in [base, *cfg.image_roots]]
        self.max_bytes = cfg.max_image_bytes
        self.limits = data_limits(cfg)
        # The caller decodes every picture right after (jobs.predict), refusing one that does
        # not decode there: a decode here as well cost a quarter of its time.
        self.decoded_after = decoded_after

    def read(self, image: Any) -> tuple[bytes | None, str | None]:
        data: bytes | None
        if isinstance(image, bytes | bytearray | memoryview):
            data = bytes(image)
        elif isinstance(image, str) and image:
            where = self.where(image)
            data = self._bytes(where) if where else None
            if data is None:
                return None, (
                    f"image {shown(image)}: cannot read (missing, not a regular file, or not "
                    "under the table's folder or data.image_roots)"
                )
            if len(data) > self.max_bytes:
                return None, (
                    f"image {shown(image)}: more than data.max_image_bytes={self.max_bytes} bytes"
                )
        else:
            return None, f"image: expected a path or bytes, got {type(image).__name__}"
        problem = None if self.decoded_after else check_picture(data, self.limits)
        where = shown(image) if isinstance(image, str) else "bytes"
        return (None, f"image {where}: {problem}") if problem else (data, None)

    def where(self, image: str) -> str | None:
        """The picture's normalised path or URI, or None when it is under no allowed root. A
        relative path may not climb out of the table's folder; an absolute one or a URI must
        lie under a listed root (the table's folder counts as one)."""
        relative = "://" not in image and not os.path.isabs(image)
        target = _normal(storage.join(self.base, image) if relative else image)
        roots = self.roots[:1] if relative else self.roots
        return target if any(_under(target, r) for r in roots) else None

    def _bytes(self, uri: str) -> bytes | None:
        """The file's bytes (no more than max_bytes + 1: more is refused by its length), or
        None if it is not a regular file."""
        from pyarrow import fs as pafs

        try:
            filesystem, path = storage.filesystem(uri)
            info = filesystem.get_file_info(path)
            if info.type != pafs.FileType.File or (storage.is_local(uri) and not _regular(path)):
                return None
            with filesystem.open_input_stream(path) as f:
                return f.read(self.max_bytes + 1)
        except (OSError, ValueError):
            return None


def _normal(uri: str) -> str:
    """A local path with symbolic links and `..` resolved; a URI with `..` collapsed."""
    if storage.is_local(uri):
        return os.path.realpath(uri.removeprefix("file://"))
    scheme, _, rest = uri.partition("://")
    return f"{scheme}://{posixpath.normpath(rest)}"


def _under(target: str, root: str) -> bool:
    return target == root or target.startswith(root.rstrip("/") + "/")


def _regular(path: str) -> bool:
    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except OSError:
        return False


# --- generated scenes ----------------------------------------------------------------------------

SHAPES = ("circle", "square", "triangle", "diamond", "cross")
COLOURS = {
    "red": (214, 39, 40),
    "green": (44, 160, 44),
    "blue": (31, 119, 180),
    "yellow": (230, 200, 30),
    "purple": (148, 103, 189),
    "orange": (255, 127, 14),
}
SIZES = ("small", "large")
POSITIONS = ("top left", "top right", "bottom left", "bottom right")
Scene = tuple[tuple[str, str, str, str], ...]  # (shape, colour, size, position) per object


def synthetic(cfg: DataConfig, batch: int = 256) -> Iterator[tuple[pd.DataFrame, np.ndarray]]:
    """`cfg.num_rows` distinct pictures of 2-3 objects (5 shapes x 6 colours x 2 sizes x 4
    positions), each with `captions_per_image` captions naming only what is drawn, in different
    orders. A tenth of them come with a twin: the same objects with two colours swapped (the
    binding subset, in one split with its twin).

    Rows come `batch` pictures at a time, each with its split key: its picture's number, or its
    twin's when that is lower, so a picture, its captions and its twin share a split."""
    rng = np.random.default_rng(cfg.seed)
    scenes, twins = _scenes(cfg.num_rows, rng)
    for start in range(0, len(scenes), batch):
        out: dict[str, list[Any]] = {IMAGE: [], CAPTION: [], IMAGE_ID: [], TWIN: []}
        keys: list[int] = []
        for i in range(start, min(start + batch, len(scenes))):
            picture = draw(scenes[i], cfg.image_size, rng)
            for caption in captions(scenes[i], cfg.captions_per_image, rng):
                out[IMAGE].append(picture)
                out[CAPTION].append(caption)
                out[IMAGE_ID].append(f"scene-{i}")
                out[TWIN].append(f"scene-{twins[i]}" if twins[i] >= 0 else "")
                keys.append(min(i, twins[i]) if twins[i] >= 0 else i)
        yield pd.DataFrame(out), np.asarray(keys, dtype=np.uint64)


def _scenes(count: int, rng: np.random.Generator) -> tuple[list[Scene], list[int]]:
    """`count` distinct scenes, and each one's twin (-1: none)."""
    scenes: list[Scene] = []
    twins: list[int] = []
    seen: set[frozenset] = set()
    while len(scenes) < count:
        scene = _scene(rng)
        if frozenset(scene) in seen:
            continue
        seen.add(frozenset(scene))
        scenes.append(scene)
        twins.append(-1)
        twin = _swapped(scene)
        if len(scenes) < count and rng.random() < 0.1 and frozenset(twin) not in seen:
            seen.add(frozenset(twin))
            twins[-1] = len(scenes) - 1
            scenes.append(twin)
            twins.append(len(scenes) - 2)
    return scenes, twins


def _scene(rng: np.random.Generator) -> Scene:
    count = int(rng.integers(2, 4))
    positions = rng.choice(len(POSITIONS), size=count, replace=False)
    return tuple(
        (
            SHAPES[rng.integers(len(SHAPES))],
            list(COLOURS)[rng.integers(len(COLOURS))],
            SIZES[rng.integers(len(SIZES))],
            POSITIONS[p],
        )
        for p in sorted(positions)
    )


def _swapped(scene: Scene) -> Scene:
    """The first two objects' colours exchanged (a different picture only if they differ)."""
    (s0, c0, z0, p0), (s1, c1, z1, p1), *rest = scene
    if c0 == c1:
        return scene
    return ((s0, c1, z0, p0), (s1, c0, z1, p1), *rest)


def captions(scene: Scene, count: int, rng: np.random.Generator) -> list[str]:
    """`count` captions of the scene, each listing every object, in different orders."""
    phrases = [
        f"a {size} {colour} {shape} at the {position}" for shape, colour, size, position in scene
    ]
    import itertools

    orders = list(itertools.permutations(range(len(phrases))))
    picked = [orders[i] for i in rng.permutation(len(orders))]
    picked = (picked * (count // len(picked) + 1))[:count]  # distinct while orders last
    out = [", ".join(phrases[i] for i in o[:-1]) + f" and {phrases[o[-1]]}" for o in picked]
    return out


def draw(scene: Scene, size: int, rng: np.random.Generator) -> bytes:
    """The scene as a PNG of `size` x `size` pixels on a lightly noisy grey ground."""
    from PIL import Image, ImageDraw

    ground = rng.integers(200, 236, (size, size, 3), dtype=np.uint8)
    img = Image.fromarray(ground, "RGB")
    pen = ImageDraw.Draw(img)
    for shape, colour, scale, position in scene:
        cx = size * (0.27 if "left" in position else 0.73)
        cy = size * (0.27 if "top" in position else 0.73)
        r = size * (0.1 if scale == "small" else 0.21)
        _shape(pen, shape, cx, cy, r, COLOURS[colour])
    buffer = io.BytesIO()
    img.save(buffer, format="PNG")
    return buffer.getvalue()


def _shape(
    pen: Any, shape: str, cx: float, cy: float, r: float, fill: tuple[int, int, int]
) -> None:
    if shape == "circle":
        pen.ellipse((cx - r, cy - r, cx + r, cy + r), fill=fill)
    elif shape == "square":
        pen.rectangle((cx - r, cy - r, cx + r, cy + r), fill=fill)
    elif shape == "triangle":
        pen.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=fill)
    elif shape == "diamond":
        pen.polygon([(cx, cy - r), (cx + r, cy), (cx, cy + r), (cx - r, cy)], fill=fill)
    else:  # cross
        w = r / 3
        pen.rectangle((cx - r, cy - w, cx + r, cy + w), fill=fill)
        pen.rectangle((cx - w, cy - r, cx + w, cy + r), fill=fill)
