"""``DecodeImage``: a transform that decodes an encoded image column in the worker (Pillow).

``python -m tools.pack --images DIR`` stores images as their encoded bytes (a few times smaller
than pixels, and mapped rather than read); decoding them is per-item work, done in the workers
through ``ArrowDataset(..., transform=DecodeImage())``. Pillow is an optional extra
(``pip install shmloader[pillow]``); it is imported when the first image is decoded.
"""

from __future__ import annotations

import io
from typing import Any

import numpy as np
import torch


class DecodeImage:
    """Replace ``item[column]`` (encoded bytes) with a ``3 x H x W`` (``mode="RGB"``) uint8
    tensor; other columns pass through. Picklable, so it works under spawn."""

    def __init__(self, column: str = "image", mode: str = "RGB") -> None:
        self.column, self.mode = column, mode

    def __call__(self, item: dict[str, Any]) -> dict[str, Any]:
        try:
            from PIL import Image
        except ImportError as exc:
            raise ImportError(
                "DecodeImage needs Pillow: pip install 'shmloader[pillow]' (or pillow)"
            ) from exc
        with Image.open(io.BytesIO(item[self.column])) as image:
            pixels = np.asarray(image.convert(self.mode))
        tensor = torch.from_numpy(pixels.copy())
        tensor = tensor.permute(2, 0, 1) if tensor.dim() == 3 else tensor.unsqueeze(0)
        return {**item, self.column: tensor.contiguous()}

    def __repr__(self) -> str:
        return f"DecodeImage(column={self.column!r}, mode={self.mode!r})"
