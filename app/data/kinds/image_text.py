"""Pictures and captions (retrieval): each row a caption of a picture held as its encoded bytes.

The fitted state decodes a picture (PIL, within `PictureLimits`: pixels and aspect ratio read
from its header first), resizes it and scales it
(to `image_size` and the train split's mean and std, or as a pretrained CLIP or ViT folder's
image processor does), and tokenizes a caption (a WordPiece tokenizer trained on the train
captions, or a pretrained folder's own). Rows of one picture share its `image_id`: a batch's
`group` numbers, which the recall metrics count every caption of a picture by.
"""

from __future__ import annotations

import hashlib
import io
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa

from app.data import checks
from app.data.kinds.text import fixed_length_tokenizer, train_tokenizer
from app.data.preprocess import Column, FitOptions, Preprocessor, Problems
from app.errors import UserError

IMAGE_ID = "image_id"
GROUP_KEY = "group"  # a picture's number in transformed batches
MAX_PIXELS = 64 * 2**20
# A picture's longer side over its shorter: a resize to a shortest edge (CLIP's) scales the
# long side with it, so a 4,194,304 x 4 picture would become gigabytes of pixels.
MAX_ASPECT = 20.0
PICTURES, CAPTIONS = 0, 1  # the width of a corpus column to embed (check_columns)
HALF = [0.5, 0.5, 0.5]


class BadPicture(ValueError):
    """Bytes that do not decode to a picture within the limits; the message says why and
    `status` is the HTTP status a request carrying it gets (413 for a size over a limit)."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


@dataclass(frozen=True, slots=True)
class PictureLimits:
    """What a picture may be, read from its header before any pixel is decoded: its pixels,
    its aspect ratio, and (for a request) the pixels of all its pictures together."""

    max_pixels: int = MAX_PIXELS
    max_aspect: float = MAX_ASPECT
    max_total_pixels: int | None = None
    pixels_key: str = "max_pixels"  # the config key a refusal names
    aspect_key: str = "max_aspect"
    total_key: str = "max_total_pixels"

    def check(self, width: int, height: int) -> None:
        if width * height > self.max_pixels:
            raise BadPicture(
                f"{width}x{height} pixels, more than {self.pixels_key}={self.max_pixels}", 413
            )
        aspect = max(width, height) / max(1, min(width, height))
        if aspect > self.max_aspect:
            raise BadPicture(
                f"{width}x{height} pixels, an aspect ratio of {aspect:.4g}, over "
                f"{self.aspect_key}={self.max_aspect:g}"
            )

    def check_total(self, sizes: Sequence[tuple[int, int]]) -> None:
        total = sum(w * h for w, h in sizes)
        if self.max_total_pixels is not None and total > self.max_total_pixels:
            raise BadPicture(
                f"{len(sizes)} pictures of {total} pixels together, more than "
                f"{self.total_key}={self.max_total_pixels}",
                413,
            )


class ImageText(Preprocessor):
    kind = "image_text"
    input_name = "image"
    labelled = False
    variable_length = True

    def __init__(self, state: dict[str, Any]):
        super().__init__(state)
        self.image_column, self.caption_column = self.feature_columns[:2]
        self.tokenizer, self._max_chars = fixed_length_tokenizer(state)
        self._processor = None
        if "image_processor" in state:  # a pretrained CLIP or ViT folder's own
            from app.data.images import ImageProcessor

            self._processor = ImageProcessor(state["image_processor"])
        self.image_size = int(state.get("image_size", 0))
        self._mean = np.asarray(state.get("mean", HALF), np.float32)[:, None, None]
        self._std = np.asarray(state.get("std", HALF), np.float32)[:, None, None]

    @classmethod
    def fit_state(
        cls, chunks: Iterator[pd.DataFrame], manifest: dict[str, Any], options: FitOptions
    ) -> dict[str, Any]:
        caption = manifest["feature_columns"][1]
        texts = (str(t) for chunk in chunks for t in chunk[caption])
        text_base = options.text_base or options.base
        image_base = options.image_base or options.base
        state: dict[str, Any] = {"max_length": options.max_length}
        if text_base is not None:
            state |= {"tokenizer": text_base.tokenizer_json(), "pad_token": text_base.pad_token()}
            for _ in texts:
                pass
        else:
            state["tokenizer"] = train_tokenizer(texts, options.vocab_size)
        if image_base is not None:
            return state | {"image_processor": image_base.image_processor()}
        shape = manifest.get("image_shape") or [3, options.image_size, options.image_size]
        return state | {"image_size": int(shape[-1]), "mean": HALF, "std": HALF}

    @property
    def output_size(self) -> int:
        if self._processor is not None:
            return int(self._processor.output_shape[-1])
        return self.image_size

    @property
    def vocab_size(self) -> int:
        return int(self.tokenizer.get_vocab_size())

    def row_bytes(self) -> int:
        return 4 * 3 * self.output_size**2 + 2 * 8 * int(self.state["max_length"]) + 8

    def input_names(self) -> list[str]:
        return ["pixels", "input_ids", "attention_mask"]

    def raw_input(self) -> dict[str, Any]:
        return {"name": self.input_name, "datatype": "BYTES", "shape": [-1]}

    def raw_inputs(self) -> list[dict[str, Any]]:
        """What a request sends: pictures (encoded bytes) or texts, each embedded alone."""
        return [self.raw_input(), {"name": "text", "datatype": "BYTES", "shape": [-1]}]

    def sample_rows(self) -> Any:
        return [blank_png(8)], ["health check"]

    # --- transforms ------------------------------------------------------------------------

    def features(self, raw: Any) -> dict[str, np.ndarray]:
        images, captions = raw
        return self.image_features(images) | self.text_features(captions)

    def image_features(
        self, images: Sequence[bytes], limits: PictureLimits = PictureLimits()
    ) -> dict[str, np.ndarray]:
        """Pictures (encoded bytes) -> `pixels` [n, 3, size, size]. Every header is checked
        against `limits` before any picture is decoded; a picture that fails raises BadPicture
        naming its index ("[k]: why"), the request's total a BadPicture without one."""
        sizes = []
        for i, data in enumerate(images):
            try:
                sizes.append(picture_size(data, limits))
            except BadPicture as e:
                raise BadPicture(f"[{i}]: {e}", e.status) from None
        limits.check_total(sizes)
        pixels = []
        for i, data in enumerate(images):
            try:
                pixels.append(self.picture_pixels(decode(data, limits)))
            except BadPicture as e:
                raise BadPicture(f"[{i}]: {e}", e.status) from None
        return {"pixels": self.stacked(pixels)}

    def picture_pixels(self, picture: np.ndarray) -> np.ndarray:
        """One decoded picture ([height, width, 3] uint8) -> [3, size, size] float32."""
        if self._processor is not None:
            return self._processor.of_pictures([picture])[0]
        return self._scaled(picture)

    def stacked(self, pixels: list[np.ndarray]) -> np.ndarray:
        size = self.output_size
        out = np.stack(pixels) if pixels else np.zeros((0, 3, size, size), np.float32)
        return np.ascontiguousarray(out, dtype=np.float32)

    def _scaled(self, picture: np.ndarray) -> np.ndarray:
        from PIL import Image

        size = self.image_size
        if picture.shape[:2] != (size, size):
            picture = np.asarray(
                Image.fromarray(picture).resize((size, size), Image.Resampling.BILINEAR)
            )
        chw = picture.transpose(2, 0, 1).astype(np.float32) / 255.0
        return (chw - self._mean) / self._std

    def text_features(self, texts: Iterable[str]) -> dict[str, np.ndarray]:
        texts = [str(t)[: self._max_chars] for t in texts]
        encoded = self.tokenizer.encode_batch(texts)
        ids = np.asarray([e.ids for e in encoded], dtype=np.int64).reshape(len(texts), -1)
        mask = np.asarray([e.attention_mask for e in encoded], dtype=np.int64)
        return {"input_ids": ids, "attention_mask": mask.reshape(len(texts), -1)}

    def raw_features(self, batch: dict[str, np.ndarray] | pd.DataFrame) -> Any:
        return list(batch[self.image_column]), [str(c) for c in batch[self.caption_column]]

    def transform_batch(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        out = self.features(self.raw_features(batch))
        out[GROUP_KEY] = np.asarray([group_number(g) for g in batch[IMAGE_ID]], dtype=np.int64)
        return out

    # --- raw data ----------------------------------------------------------------------------

    @classmethod
    def arrow_column(cls, name: str, values: pd.Series) -> pa.Array:
        if values.map(lambda v: isinstance(v, bytes)).all():
            return pa.array(values.to_list(), type=pa.binary())
        return pa.array(values.astype(str).to_list(), type=pa.string())

    @classmethod
    def sample_tensor(cls, frame: pd.DataFrame, columns: list[str]) -> dict[str, Any]:
        texts = frame[columns[1]].astype(str).tolist()
        return {"name": "text", "datatype": "BYTES", "shape": [len(texts)], "data": texts}

    @classmethod
    def check_columns(
        cls, columns: dict[str, Column], names: list[str], width: int
    ) -> tuple[Any, Problems]:
        """A corpus to embed: its one column, of captions (`width` CAPTIONS) or of pictures'
        encoded bytes (PICTURES)."""
        name = names[0]
        if width == CAPTIONS:
            return checks.texts(columns[name], name)
        values, problems = checks.values_of(columns[name]), {}
        for i, value in enumerate(values):
            problem = checks.absent(name, value)
            if problem is None and not isinstance(value, bytes | bytearray):
                problem = f"column {name!r}: expected a picture's bytes, got {type(value).__name__}"
            if problem is None and (why := why_not_picture(bytes(value))):
                problem = f"column {name!r}: {why}"
            if problem:
                problems[i] = problem
        return values, problems

    @classmethod
    def good_rows(cls, raw: Any, good: np.ndarray, width: int) -> Any:
        return [raw[i] for i in good]


def picture_size(data: bytes, limits: PictureLimits = PictureLimits()) -> tuple[int, int]:
    """A picture's (width, height) from its header, within `limits` (nothing decoded)."""
    from PIL import Image

    try:
        with Image.open(io.BytesIO(bytes(data))) as img:
            width, height = img.size
    except Exception as e:  # noqa: BLE001 - PIL signals a bad file in many ways
        raise BadPicture(f"not a picture ({_failure(e)})") from None
    limits.check(width, height)
    return width, height


def decode(data: bytes, limits: PictureLimits = PictureLimits()) -> np.ndarray:
    """Encoded picture bytes -> [height, width, 3] uint8, its size checked against `limits`
    before decoding (a small file can decode to gigabytes)."""
    from PIL import Image

    try:
        with Image.open(io.BytesIO(bytes(data))) as img:
            limits.check(*img.size)
            rgb = img if img.mode == "RGB" else img.convert("RGB")  # no copy when it is already
            return np.asarray(rgb, dtype=np.uint8)
    except BadPicture:
        raise
    except Exception as e:  # noqa: BLE001 - PIL signals a bad file in many ways
        raise BadPicture(f"not a picture ({_failure(e)})") from None


def why_not_picture(data: bytes, limits: PictureLimits = PictureLimits()) -> str | None:
    """Why bytes are not a picture within `limits`, from their header alone (a full decode
    comes later, one picture at a time)."""
    try:
        picture_size(data, limits)
    except BadPicture as e:
        return str(e)
    return None


def _failure(e: Exception) -> str:
    detail = (str(e).strip().splitlines() or [""])[0][:80]
    return f"{type(e).__name__}: {detail}"


def group_number(image_id: Any) -> int:
    """A picture's number from its id, the same in every process (recall counts by it)."""
    return int.from_bytes(hashlib.sha256(str(image_id).encode()).digest()[:7], "little")


def blank_png(size: int) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (size, size), (128, 128, 128)).save(buffer, format="PNG")
    return buffer.getvalue()


def require(pre: Preprocessor) -> ImageText:
    """A retrieval model's preprocessor, narrowed to its kind."""
    if not isinstance(pre, ImageText):
        raise UserError(f"expected pictures and captions, got {pre.kind} data")
    return pre
