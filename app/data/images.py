"""A pretrained image model's preprocessing, as its `preprocessor_config.json` describes it:
resize (PIL, the processor's resampling filter), rescale, normalize, channels first. Written
with PIL and numpy (torchvision is not a dependency); transformers' ViT image processor gives the
same pixels to within 1/255 (tests/unit/test_pretrained.py).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from app.errors import ConfigError

IMAGENET_HALF = [0.5, 0.5, 0.5]  # ViT's default mean and std


class ImageProcessor:
    def __init__(self, spec: dict[str, Any]):
        self.spec = spec
        size = spec.get("size", 224)
        # CLIP's: the shortest edge resized to a length (aspect kept), then a centre crop.
        edge = size.get("shortest_edge") if isinstance(size, dict) else None
        self.shortest_edge: int | None = int(edge) if edge is not None else None
        self.crop = _size(spec["crop_size"]) if spec.get("do_center_crop") else None
        self.size = self.crop or _size(size)
        self.resample = int(spec.get("resample", 2))  # PIL's BILINEAR
        self.do_resize = bool(spec.get("do_resize", True))
        self.rescale = (
            float(spec.get("rescale_factor", 1 / 255)) if spec.get("do_rescale", True) else 1.0
        )
        normalize = spec.get("do_normalize", True)
        self.mean = np.asarray(
            spec.get("image_mean", IMAGENET_HALF) if normalize else [0.0] * 3, np.float32
        )
        self.std = np.asarray(
            spec.get("image_std", IMAGENET_HALF) if normalize else [1.0] * 3, np.float32
        )

    @property
    def output_shape(self) -> tuple[int, int, int]:
        return (3, *self.size)

    def of_pictures(self, pictures: list[np.ndarray]) -> np.ndarray:
        """Decoded pictures ([height, width, 3] uint8, any sizes) -> [n, 3, h, w] float32
        model inputs, as the folder's processor makes them."""
        if self.shortest_edge is None:
            return (
                self(np.stack([self._one(p) for p in pictures]).transpose(0, 3, 1, 2))
                if pictures
                else self(np.zeros((0, 3, *self.size), np.uint8))
            )
        out = (
            np.stack([self._crop(self._shortest(p)) for p in pictures])
            if pictures
            else np.zeros((0, *self.size, 3))
        )
        out = (out.astype(np.float32) * self.rescale - self.mean) / self.std
        return np.ascontiguousarray(out.transpose(0, 3, 1, 2), dtype=np.float32)

    def _shortest(self, picture: np.ndarray) -> np.ndarray:
        """transformers' resize to a shortest edge: the long side scaled and truncated."""
        from PIL import Image

        assert self.shortest_edge is not None
        height, width = picture.shape[:2]
        short, long = (height, width) if height <= width else (width, height)
        new_short, new_long = self.shortest_edge, int(self.shortest_edge * long / short)
        new_h, new_w = (new_short, new_long) if height <= width else (new_long, new_short)
        if (new_h, new_w) == (height, width):
            return picture
        return np.asarray(Image.fromarray(picture).resize((new_w, new_h), resample=self.resample))

    def _crop(self, picture: np.ndarray) -> np.ndarray:
        assert self.crop is not None
        height, width = picture.shape[:2]
        crop_h, crop_w = self.crop
        top, left = (height - crop_h) // 2, (width - crop_w) // 2
        return picture[top : top + crop_h, left : left + crop_w]

    def __call__(self, images: np.ndarray) -> np.ndarray:
        """[n, channels, height, width] pixel values 0..255 (1 or 3 channels) -> [n, 3, h, w]
        float32 model inputs."""
        if images.shape[1] not in (1, 3):
            raise ValueError(f"images need 1 or 3 channels, got {images.shape[1]}")
        pixels = np.clip(np.rint(images), 0, 255).astype(np.uint8).transpose(0, 2, 3, 1)
        if pixels.shape[-1] == 1:
            pixels = np.repeat(pixels, 3, axis=-1)
        out = (
            np.stack([self._one(p) for p in pixels])
            if len(pixels)
            else np.zeros((0, *self.size, 3))
        )
        out = (out.astype(np.float32) * self.rescale - self.mean) / self.std
        return np.ascontiguousarray(out.transpose(0, 3, 1, 2), dtype=np.float32)

    def _one(self, pixels: np.ndarray) -> np.ndarray:
        if not self.do_resize or pixels.shape[:2] == self.size:
            return pixels
        from PIL import Image

        height, width = self.size
        return np.asarray(Image.fromarray(pixels).resize((width, height), resample=self.resample))


def _size(size: Any) -> tuple[int, int]:
    if isinstance(size, int):
        return size, size
    if isinstance(size, dict) and "height" in size and "width" in size:
        return int(size["height"]), int(size["width"])
    raise ConfigError(
        f"config error: model.pretrained: preprocessor_config.json size {size!r} is not supported "
        "(expected {height, width} or one number)"
    )
