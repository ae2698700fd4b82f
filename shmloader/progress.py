"""Where each worker's streams stand as of the last batch the user consumed from it: what
``DataLoader.state_dict()`` saves of the workers, and what a resumed iterator gives them back.

Per worker, two streams:

- **RNG** (every dataset): the torch / ``random`` / NumPy snapshot the worker published in the
  RNG ring (:mod:`shmloader.rngstate`) after its last consumed task; before any, the snapshot the
  iterator was resumed with, or ``None`` where the worker's seed alone gives it.
- **Replica** (IterableDatasets only; each worker iterates its own replica): how many batches
  of the epoch were consumed from the worker and, for a dataset with ``state_dict`` /
  ``load_state_dict`` (torchdata's ``Stateful`` protocol), the replica's ``state_dict()`` after
  the last of them. The worker pickles it after each batch and sends it (``REPLICA``) just before
  the batch's answer; the main process keeps it until that batch is consumed. A resumed worker
  calls ``load_state_dict`` with it before ``iter()``; a replica without the protocol is fast-
  forwarded instead (the batches already consumed are fetched again and dropped), which is exact
  for a replica that iterates the same way every time. Either way its RNG snapshot is restored
  afterwards, so augmentations continue the saved stream.

For IterableDatasets the workers of the tasks in flight are saved too (``assign``, in sampler
order, with torch's round-robin pointer after them): a replica found exhausted leaves the round
robin, so the worker of a batch depends on the history, and a resumed iterator replays it. It
starts with every worker active: a replica that was exhausted is exhausted again at its first
task (restored to its end) and yields nothing there, so the batches yielded come in the same
order as the uninterrupted run's.

Invariant: only batches the user consumed (yielded, or raised) advance a worker's record; a
batch that was prefetched but not consumed is produced again after a resume, never lost or
duplicated. Costs nothing per batch for map-style datasets beyond one tuple store.
"""

from __future__ import annotations

import pickle
from typing import Any

from shmloader import protocol as P
from shmloader.rngstate import RngRing


class WorkerProgress:
    """The per-worker records of one iterator (see the module docstring)."""

    def __init__(
        self,
        num_workers: int,
        ring: RngRing,
        iterable: bool,
        rng_carry: list[bytes | None] | None = None,
        replicas: dict[str, Any] | None = None,
    ) -> None:
        self.ring = ring
        self.iterable = iterable
        self.rng_carry: list[bytes | None] = rng_carry or [None] * num_workers
        self.rng_last: list[tuple[int, int] | None] = [None] * num_workers
        # A resumed epoch starts from the saved replicas; a fresh one from nothing consumed.
        saved = replicas["workers"] if replicas else None
        self.batches = [r["batches"] for r in saved] if saved else [0] * num_workers
        self.states: list[bytes | None] = (
            [pickle.dumps(r["state"]) if "state" in r else None for r in saved]
            if saved
            else [None] * num_workers
        )
        self.pending: list[dict[int, bytes]] = [{} for _ in range(num_workers)]

    def restore_for(self, worker_id: int, index: Any) -> dict[str, Any] | None:
        """What a resumed worker's replica starts from (``WorkerConfig.replica_restore``);
        ``index`` is what the sampler gives an IterableDataset's fetcher for one batch."""
        if not self.iterable or not (self.batches[worker_id] or self.states[worker_id]):
            return None
        return {
            "batches": self.batches[worker_id],
            "state": self.states[worker_id],
            "index": index,
        }

    def new_epoch(self) -> None:
        n = len(self.batches)
        self.batches = [0] * n
        self.states = [None] * n
        self.pending = [{} for _ in range(n)]

    def orphan_answered(self, worker_id: int, epoch: int, seq: int) -> None:
        """A task of an abandoned epoch was answered: the worker's RNG has moved past it."""
        self.rng_last[worker_id] = (epoch, seq)

    def replica_state(self, msg: P.ReplicaState, epoch: int) -> None:
        if msg.epoch == epoch:
            self.pending[msg.worker_id][msg.seq] = msg.state

    def consumed(self, worker_id: int, epoch: int, seq: int) -> None:
        """The user got the batch (or the error) of task ``seq`` of ``worker_id``."""
        self.rng_last[worker_id] = (epoch, seq)
        if self.iterable:
            self.batches[worker_id] += 1
            state = self.pending[worker_id].pop(seq, None)
            if state is not None:
                self.states[worker_id] = state

    def rng_states(self) -> list[bytes | None]:
        return [
            self.rng_carry[w] if last is None else self.ring.read(w, *last)
            for w, last in enumerate(self.rng_last)
        ]

    def replica_record(self, assign: list[int], next_worker: int) -> dict[str, Any] | None:
        """The ``replicas`` entry of the state (None for map-style datasets)."""
        if not self.iterable:
            return None
        workers = []
        for wid, (n, st) in enumerate(zip(self.batches, self.states, strict=True)):
            entry: dict[str, Any] = {"batches": n}
            if st is not None and st.startswith(P.UNSAVABLE):
                raise RuntimeError(
                    f"cannot save the DataLoader's state: worker {wid}'s dataset replica "
                    f"state_dict() could not be taken or pickled "
                    f"({st[len(P.UNSAVABLE):].decode(errors='replace')}); make its state_dict() "
                    "return picklable values (numbers, strings, tensors, dicts and lists of them)"
                )
            if st is not None:
                entry["state"] = pickle.loads(st)
            workers.append(entry)
        return {
            "workers": workers,
            "assign": assign,
            "next_worker": next_worker,
        }


class SamplerProgress:
    """Where one epoch's sampler stands: positions drawn, and which batches were consumed.

    A batch's position is its index in the sampler's order. With ``in_order=True`` the consumed
    batches are always the first ``_num_yielded``; with ``in_order=False`` they are a prefix
    (``prefix``) plus a set past it (``done``), which is what a saved state records. A resumed
    epoch starts drawing at ``start`` and passes over the positions in ``consumed_past`` without
    sending them.
    """

    __slots__ = ("count", "done", "next", "of_seq", "prefix", "skip")

    def __init__(self, start: int = 0, consumed_past: tuple[int, ...] | list[int] = ()) -> None:
        self.next = start  # sampler position of the next index drawn
        self.count = start  # batches consumed (yielded, or raised; never produced again)
        self.skip = set(consumed_past)  # consumed before a resume: drawn, never sent
        self.prefix = start  # in_order=False: positions below it are all consumed ...
        self.done = set(self.skip)  # ... and these past it
        self.of_seq: list[int] = []  # in_order=False: task seq -> sampler position

    def draw(self, next_index: Any) -> Any:
        """The next index to send (``next_index()`` raises StopIteration at the end); its
        position is ``self.next - 1``."""
        index = next_index()
        while self.skip and self.next in self.skip:
            self.skip.discard(self.next)
            self.next += 1
            index = next_index()
        self.next += 1
        return index

    def record(self, in_order: bool) -> tuple[int, list[int]]:
        """What a saved state records: the consumed prefix, and the positions past it."""
        return (self.count, []) if in_order else (self.prefix, sorted(self.done))

    def consumed(self, seq: int) -> None:
        """in_order=False: the batch of task ``seq`` was consumed."""
        pos = self.of_seq[seq]
        if pos != self.prefix:
            self.done.add(pos)
            return
        self.prefix += 1
        while self.prefix in self.done:
            self.done.discard(self.prefix)
            self.prefix += 1
