"""Pinning: page-lock each slab once with CUDA so every batch is born pinned.

With ``pin_memory=True`` and an accelerator present, every slab the arena creates is registered
with the CUDA driver (``cudaHostRegister``) when the main process first maps it, and unregistered
at teardown. Views of a registered slab report ``is_pinned()`` and copy to the GPU asynchronously;
no batch is copied to be pinned and there is no pin thread.

If registration fails (locked-memory limits, a driver without support), the pinner falls back to
torch's per-batch pinning copy and warns once, saying why.

Invariants:
- Each slab is registered at most once and unregistered exactly once (when the arena gives it
  back, :meth:`Pinner.unregister`, or at :meth:`Pinner.close`).
- ``pinned_bytes`` is the sum of the sizes of registered slabs.
- The registrar is a seam (:class:`Registrar`): tests pass a fake that records calls.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np
import torch

from arena import Slab, userwarn
from shmloader._torch_compat import pin_memory, wrap_current_exception
from shmloader.notes import reraise

# cudaHostRegisterDefault; a slab is registered in chunks of at most this many bytes, since some
# drivers reject very large single registrations.
_FLAGS = 0
CHUNK_BYTES = 1 << 30


class Registrar(Protocol):
    def register(self, ptr: int, nbytes: int) -> None: ...

    def unregister(self, ptr: int) -> None: ...


class CudaRegistrar:
    """``cudaHostRegister`` / ``cudaHostUnregister`` through torch's cudart bindings."""

    def register(self, ptr: int, nbytes: int) -> None:
        cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
        err = cudart.cudaHostRegister(ptr, nbytes, _FLAGS)
        if int(err) != 0:
            raise RuntimeError(f"cudaHostRegister({nbytes:,} bytes) failed with error {int(err)}")

    def unregister(self, ptr: int) -> None:
        torch.cuda.cudart().cudaHostUnregister(ptr)  # type: ignore[no-untyped-call]


def _device_index() -> int:
    """The current accelerator's index, which torch's pin thread names in its errors."""
    try:
        return int(torch.accelerator.current_device_index())
    except Exception:  # noqa: BLE001 - no accelerator: torch would not pin at all
        return 0


def _base_address(slab: Slab) -> int:
    return int(np.frombuffer(slab.segment.buffer, np.uint8, count=1).ctypes.data)


class Pinner:
    """Registers slabs (or, after a failure, pins batches by copying, as torch does)."""

    def __init__(
        self, enabled: bool, device: str | None, registrar: Registrar | None = None
    ) -> None:
        self.enabled = enabled
        self.device = device
        self.fallback = False
        self.pinned_bytes = 0
        self._registrar = registrar
        self._chunks: dict[int, tuple[list[int], int]] = {}  # slab id -> (chunk pointers, bytes)
        self._slabs: set[int] = set()

    def register(self, slab: Slab) -> None:
        """Page-lock ``slab`` (once); on failure switch to copying and warn."""
        if not self.enabled or self.fallback or slab.slab_id in self._slabs:
            return
        self._slabs.add(slab.slab_id)
        registrar = self._registrar or CudaRegistrar()
        self._registrar = registrar
        base = _base_address(slab)
        done: list[int] = []
        try:
            for off in range(0, slab.size, CHUNK_BYTES):
                registrar.register(base + off, min(CHUNK_BYTES, slab.size - off))
                done.append(base + off)
        # Driver and binding errors come in many types; each one means "cannot pin in place".
        except Exception as e:  # noqa: BLE001
            for ptr in done:
                registrar.unregister(ptr)
            self.fallback = True
            userwarn.warn(
                f"shmloader could not page-lock a {slab.size:,}-byte arena slab ({e}); it falls "
                "back to copying each batch into pinned memory, as torch's DataLoader does. "
                "Raise the locked-memory limit (ulimit -l) to pin the arena in place.",
                RuntimeWarning,
            )
            return
        self._chunks[slab.slab_id] = (done, slab.size)
        self.pinned_bytes += slab.size

    def registered(self, slab_id: int) -> bool:
        """Whether ``slab_id`` is page-locked (its views copy to the GPU asynchronously)."""
        return slab_id in self._chunks

    def unregister(self, slab_id: int) -> None:
        """Unlock one slab before the arena gives it back. A no-op for a slab never pinned."""
        chunks, nbytes = self._chunks.pop(slab_id, ([], 0))
        for ptr in chunks:
            if self._registrar is not None:
                self._registrar.unregister(ptr)
        self.pinned_bytes -= nbytes

    def pin(self, batch: Any) -> Any:
        """The batch as the user gets it, through torch's own pinning walk: custom types'
        ``pin_memory()`` is honoured; views of a registered slab are already pinned, so torch
        returns them as they are (no copy); anything else (and every tensor after a failed
        registration) is copied into pinned memory, as torch does."""
        if not self.enabled:
            return batch
        try:
            return pin_memory(batch, self.device)
        except Exception:  # noqa: BLE001
            # a custom pin_memory() raised: torch's pin thread wraps it so
            wrapped = wrap_current_exception(f"in pin memory thread for device {_device_index()}")
            reraise(wrapped)

    def close(self) -> None:
        """Unregister every chunk. Idempotent."""
        for slab_id in list(self._chunks):
            self.unregister(slab_id)
        self.pinned_bytes = 0
