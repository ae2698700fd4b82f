"""The mapping between torch dtypes and the arena's dtype codes (``arena._layout.DTYPES``).

Invariant: ``TORCH_DTYPE[CODE_OF[d]] is d`` for every dtype a slot can carry; a dtype missing
from ``CODE_OF`` (quantized, bits) travels pickled in the payload instead.
"""

from __future__ import annotations

from typing import Final

import numpy as np
import torch

from arena import DTYPE_CODE, DTYPES

_NAMES: Final = {
    torch.bool: "bool",
    torch.uint8: "uint8",
    torch.int8: "int8",
    torch.int16: "int16",
    torch.int32: "int32",
    torch.int64: "int64",
    torch.float16: "float16",
    torch.float32: "float32",
    torch.float64: "float64",
    torch.complex64: "complex64",
    torch.complex128: "complex128",
    torch.uint16: "uint16",
    torch.uint32: "uint32",
    torch.uint64: "uint64",
    torch.bfloat16: "bfloat16",
    torch.complex32: "complex32",
    torch.float8_e4m3fn: "float8_e4m3fn",
    torch.float8_e5m2: "float8_e5m2",
    torch.float8_e4m3fnuz: "float8_e4m3fnuz",
    torch.float8_e5m2fnuz: "float8_e5m2fnuz",
}

CODE_OF: Final[dict[torch.dtype, int]] = {d: DTYPE_CODE[n] for d, n in _NAMES.items()}
TORCH_DTYPE: Final[dict[int, torch.dtype]] = {c: d for d, c in CODE_OF.items()}

# torch dtype -> the NumPy dtype with the same bytes (dtypes NumPy lacks are absent)
NUMPY_DTYPE: Final[dict[torch.dtype, np.dtype]] = {
    d: np.dtype(DTYPES[c][0]) for d, c in CODE_OF.items() if DTYPES[c][2]
}
