"""Collate functions for ``ArrowDataset`` batches with variable-length list columns.

torch's ``default_collate`` stacks a variable-length column only when every row of the batch has
the same length (and raises otherwise); these two keep the fast path (whole columns gathered
straight into the slot) and batch such columns differently:

- :func:`collate_ragged`: a list of 1-D tensors per variable-length column;
- :func:`collate_padded`: a tuple ``(padded [B, max L], lengths [B] int64)`` per such column,
  padded with zeros (``torch.nn.utils.rnn.pack_padded_sequence`` takes both).

Every other column is batched as ``default_collate`` batches it. Both need the rows an
``ArrowDataset`` without a transform returns from ``__getitems__`` (torch's DataLoader passes
them on as well, so both loaders give the same batches).
"""

from __future__ import annotations

from typing import Any

from shmloader.arrow.columns import Ragged
from shmloader.arrow.rows import ArrowRows
from shmloader.collate import empty


def _alloc(shape: tuple[int, ...], dtype: Any) -> Any:
    return empty(shape, dtype=dtype)


def _collate(rows: Any, ragged: Ragged) -> dict[str, Any]:
    if not isinstance(rows, ArrowRows) or rows._filled:
        raise TypeError(
            f"shmloader.arrow collate functions take the rows ArrowDataset.__getitems__ returns "
            f"(a dataset without a transform), got {type(rows).__name__}; with a transform, pad "
            f"in your own collate_fn (torch.nn.utils.rnn.pad_sequence)"
        )
    return rows._dataset._collate(rows._where, _alloc, ragged)


def collate_ragged(rows: Any) -> dict[str, Any]:
    """The batch ``default_collate`` gives, with each variable-length list column as a list of
    1-D tensors."""
    return _collate(rows, "list")


def collate_padded(rows: Any) -> dict[str, Any]:
    """The batch ``default_collate`` gives, with each variable-length list column as
    ``(zero-padded [B, max L] tensor, int64 lengths [B])``."""
    return _collate(rows, "pad")
