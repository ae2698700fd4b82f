"""The error an unusable Arrow source raises: it names the file, and the column and row if any."""

from __future__ import annotations


class ArrowSourceError(ValueError):
    """A source ``ArrowDataset`` cannot serve: not Arrow, compressed, truncated or changed while
    mapped, a missing or unsupported column, a null. The message names the file (and column and
    row where there is one) and the fix."""
