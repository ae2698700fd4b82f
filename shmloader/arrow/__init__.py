"""Arrow datasets for low-RAM multi-worker jobs: memory-mapped, gathered straight into the slot.

::

    from shmloader.arrow import ArrowDataset
    ds = ArrowDataset("train.arrow", columns=["pixels", "label"])
    loader = shmloader.DataLoader(ds, batch_size=256, shuffle=True, num_workers=8)

Public names: :class:`ArrowDataset`, :class:`ArrowSourceError`, :func:`collate_ragged` and
:func:`collate_padded` (batches with variable-length list columns), :class:`DecodeImage` (a
transform decoding an encoded image column with Pillow). ``python -m tools.pack`` writes the
files from Parquet, CSV, NumPy arrays or an image folder.

Modules: ``shard`` (one mapped source), ``columns`` (the gather plans), ``build`` (Arrow type to
plan, null check), ``rows`` (the lazily gathered batch of rows), ``dataset``, ``collate``,
``images``, ``errors``.
"""

from shmloader.arrow.collate import collate_padded, collate_ragged
from shmloader.arrow.dataset import ArrowDataset
from shmloader.arrow.errors import ArrowSourceError
from shmloader.arrow.images import DecodeImage

__all__ = ["ArrowDataset", "ArrowSourceError", "DecodeImage", "collate_padded", "collate_ragged"]
