"""Where each worker's streams stand as of the last batch the user consumed from it: what
``DataLoader.state_dict()`` saves of the workers, and what a resumed iterator gives them back.

Per worker, two streams:

- **RNG** (every dataset): the torch / ``random`` / NumPy snapshot the worker published in the
  RNG ring (:mod:`shmloader.rngstate`) after its last consumed task; before any, the snapshot the
  iterator was resumed with, or ``None`` where the worker's seed alone gives it.
- **Replica** (IterableDatasets only; each worker iterates its own replica): how many batches
  of the epoch were consumed from the worker and, for a dataset with ``state_dict`` /
  ``load_state_dict`` (torchdata's ``Stateful`` protocol), the replica's ``state_dict()`` after
  the last of them, and whether the replica ran out inside that batch (a short last batch: its
  ``state_dict()`` may name the start of a pass it rewound to). The worker pickles it after each
  batch and sends it (``REPLICA``) just before the batch's answer; the main process keeps it
  until that batch is consumed. A resumed worker calls ``load_state_dict`` with it before
  ``iter()``, and a replica that had run out ends at its first fetch, as torch's fetcher does
  after a short batch; a replica without the protocol is fast-
  forwarded instead (the batches already consumed are fetched again and dropped), which is exact
  for a replica that iterates the same way from the same RNGs: it replays from the worker's RNG
  as the epoch's ``iter()`` found it (``epoch_rng``, taken at the worker's first consumed batch
  of the epoch; persistent workers carry their RNG across epochs). Either way its RNG snapshot
  is restored afterwards, so augmentations continue the saved stream. Between epochs no replica
  state is saved: the next epoch starts from each replica's ``iter()``.

A task consumed without a batch moves the RNG record too: an abandoned epoch's answers read
ahead, and (once the epoch has ended) EXHAUSTED answers (:meth:`WorkerProgress.moved_past`).
While a consumer holds batches unseen (a ``DevicePrefetcher``), each consumed batch's changes
are logged (``undo``) so that a state can be taken as of before them (:meth:`behind`).

For IterableDatasets the workers of the tasks in flight are saved too (``assign``, in sampler
order, with torch's round-robin pointer after them): a replica found exhausted leaves the round
robin, so the worker of a batch depends on the history, and a resumed iterator replays it. It
starts with every worker active: a replica that was exhausted is exhausted again at its first
task (restored to its end) and yields nothing there, so the batches yielded come in the same
order as the uninterrupted run's.

Invariant: only batches the user consumed (yielded, or raised) advance a worker's record; a
batch that was prefetched but not consumed is produced again after a resume, never lost or
duplicated. Costs nothing per batch for map-style datasets beyond one tuple store (and a tuple
appended to ``undo`` while a prefetcher asked for it).
"""

from __future__ import annotations

import copy
import pickle
from collections import deque
from collections.abc import Sequence
from typing import Any, NamedTuple, TypeVar

from shmloader import protocol as P
from shmloader.rngstate import RngRing

T = TypeVar("T")


class Replica(NamedTuple):
    """A stateful replica's record after a batch: its pickled ``state_dict()`` (or
    ``P.UNSAVABLE`` + why), and whether it ran out inside that batch (a short last batch: a
    resumed worker's fetcher ends at once, as torch's did, whatever the state says)."""

    state: bytes
    ended: bool


def last_logged(log: deque[T] | None, batches: int) -> list[T]:
    """The last ``batches`` entries of a log kept while a consumer holds batches unseen (a
    ``DevicePrefetcher``): what a state saved behind them rewinds. Raises when fewer were
    kept (the prefetcher came after the batches it holds were consumed)."""
    kept = 0 if log is None else len(log)
    if log is None or kept < batches:
        raise RuntimeError(
            f"cannot save the DataLoader's state {batches} batches behind the iterator (the "
            f"batches a DevicePrefetcher holds ahead of you): only {kept} are recorded; make "
            "the DevicePrefetcher before the loader's iter()"
        )
    return list(log)[len(log) - batches :]


class WorkerProgress:
    """The per-worker records of one iterator (see the module docstring)."""

    def __init__(
        self,
        num_workers: int,
        ring: RngRing,
        iterable: bool,
        rng_carry: list[bytes | None] | None = None,
        replicas: dict[str, Any] | None = None,
        mid_epoch: bool = False,
    ) -> None:
        self.ring = ring
        self.iterable = iterable
        self.rng_carry: list[bytes | None] = rng_carry or [None] * num_workers
        self.rng_last: list[tuple[int, int] | None] = [None] * num_workers
        # A resumed epoch starts from the saved replicas; a fresh one from nothing consumed.
        saved = replicas["workers"] if replicas else None
        self.batches = [r["batches"] for r in saved] if saved else [0] * num_workers
        # Per worker: the replica's state after its last consumed batch of the epoch, or, before
        # any, as the epoch's iter() found it (a persistent replica carries state across epochs).
        self.states: list[Replica | None] = (
            [
                Replica(pickle.dumps(r["state"]), r.get("ended", False)) if "state" in r else None
                for r in saved
            ]
            if saved
            else [None] * num_workers
        )
        self.pending: list[dict[int, Replica]] = [{} for _ in range(num_workers)]
        # Per worker: its RNG as the epoch's iter() of its replica found it (IterableDatasets):
        # a fast-forward replays from there. None: the worker's seed and worker_init_fn give it.
        # Taken at the worker's first consumed batch of the epoch (``_epoch_rng_due``).
        if mid_epoch and saved:
            self.epoch_rng: list[bytes | None] = [r.get("epoch_rng") for r in saved]
        else:  # a fresh iterator, or one resumed between epochs: its workers start there
            self.epoch_rng = list(self.rng_carry)
        self._epoch_rng_due = [False] * num_workers
        # What each consumed batch changed, latest last, while a consumer holds batches taken
        # ahead of its user (a DevicePrefetcher): the state is saved as of before them.
        self.undo: deque[tuple[Any, ...]] | None = None

    def restore_for(self, worker_id: int, index: Any) -> dict[str, Any] | None:
        """What a resumed worker's replica starts from (``WorkerConfig.replica_restore``);
        ``index`` is what the sampler gives an IterableDataset's fetcher for one batch."""
        rec = self.states[worker_id]
        if not self.iterable or not (self.batches[worker_id] or rec):
            return None
        return {
            "batches": self.batches[worker_id],
            "state": None if rec is None else rec.state,
            "ended": rec is not None and rec.ended,
            "index": index,
        }

    def new_epoch(self) -> None:
        """Persistent workers begin an epoch: no batch of it consumed, each replica from its
        ``iter()`` (a replica's state is carried between epochs by no state: see the README's
        IterableDataset note), each worker's RNG as the epoch found it (taken at its first batch
        consumed, or at a state saved before)."""
        n = len(self.batches)
        self.batches = [0] * n
        self.states = [None] * n
        self.pending = [{} for _ in range(n)]
        self._epoch_rng_due = [self.iterable] * n

    def moved_past(self, worker_id: int, epoch: int, seq: int) -> None:
        """A task of an abandoned epoch was answered (or its answer was read and the epoch
        abandoned before the user consumed it): the worker's RNG has moved past it."""
        self.rng_last[worker_id] = (epoch, seq)

    def replica_state(self, msg: P.ReplicaState, epoch: int) -> None:
        if msg.epoch == epoch:
            self.pending[msg.worker_id][msg.seq] = Replica(msg.state, msg.ended)

    def consumed(self, worker_id: int, epoch: int, seq: int) -> None:
        """The user got the batch (or the error) of task ``seq`` of ``worker_id``."""
        if self.undo is not None:
            w = worker_id
            self.undo.append(
                (w, seq, self.rng_last[w], self.batches[w], self.states[w],
                 self._epoch_rng_due[w], self.epoch_rng[w])
            )  # fmt: skip
        if self._epoch_rng_due[worker_id]:
            self._epoch_rng_due[worker_id] = False
            self.epoch_rng[worker_id] = self._rng_now(worker_id)
        self.rng_last[worker_id] = (epoch, seq)
        if self.iterable:
            self.batches[worker_id] += 1
            state = self.pending[worker_id].pop(seq, None)
            if state is not None:
                self.states[worker_id] = state

    def _rng_now(self, worker_id: int, last: tuple[int, int] | None = None) -> bytes | None:
        """Worker ``worker_id``'s RNG after task ``last`` (default: its last consumed one)."""
        last = last or self.rng_last[worker_id]
        return self.rng_carry[worker_id] if last is None else self.ring.read(worker_id, *last)

    def rng_states(
        self, moved_past: Sequence[tuple[int, int]] = (), epoch: int = 0
    ) -> list[bytes | None]:
        """Each worker's RNG as of its last consumed task, or past ``moved_past`` (``(seq,
        worker)`` of tasks of ``epoch`` that left nothing to consume: an ended epoch's
        EXHAUSTED answers)."""
        last = list(self.rng_last)
        for seq, wid in sorted(moved_past):
            last[wid] = (epoch, seq)
        return [self._rng_now(w, at) for w, at in enumerate(last)]

    def behind(self, batches: int) -> tuple[WorkerProgress, dict[int, int]]:
        """These records as they were ``batches`` consumed batches ago (a copy), and the tasks
        of those batches (``seq -> worker``), in flight again as far as a saved state goes."""
        if not batches:
            return self, {}
        entries = last_logged(self.undo, batches)
        view = copy.copy(self)
        view.undo = None
        view.rng_last, view.batches, view.states = (
            list(self.rng_last), list(self.batches), list(self.states)
        )
        view._epoch_rng_due, view.epoch_rng = list(self._epoch_rng_due), list(self.epoch_rng)
        back: dict[int, int] = {}
        for entry in reversed(entries):
            w, seq, last, n, st, due, rng = entry
            view.rng_last[w], view.batches[w], view.states[w] = last, n, st
            view._epoch_rng_due[w], view.epoch_rng[w] = due, rng
            back[seq] = w
        return view, back

    def replica_record(self, assign: list[int], next_worker: int) -> dict[str, Any] | None:
        """The ``replicas`` entry of the state (None for map-style datasets)."""
        if not self.iterable:
            return None
        workers = []
        for wid, (n, rec) in enumerate(zip(self.batches, self.states, strict=True)):
            entry: dict[str, Any] = {"batches": n}
            st = None if rec is None else rec.state
            if st is not None and st.startswith(P.UNSAVABLE):
                raise RuntimeError(
                    f"cannot save the DataLoader's state: worker {wid}'s dataset replica "
                    f"state_dict() could not be taken or pickled "
                    f"({st[len(P.UNSAVABLE):].decode(errors='replace')}); make its state_dict() "
                    "return picklable values (numbers, strings, tensors, dicts and lists of them)"
                )
            if st is not None:
                entry["state"] = pickle.loads(st)
            if rec is not None and rec.ended:  # (absent: not ended, as in states saved before)
                entry["ended"] = True
            rng = self._rng_now(wid) if self._epoch_rng_due[wid] else self.epoch_rng[wid]
            if rng is not None:
                entry["epoch_rng"] = rng
            workers.append(entry)
        return {"workers": workers, "assign": assign, "next_worker": next_worker}


class SamplerProgress:
    """Where one epoch's sampler stands: positions drawn, and which batches were consumed.

    A batch's position is its index in the sampler's order. With ``in_order=True`` the consumed
    batches are always the first ``_num_yielded``; with ``in_order=False`` they are a prefix
    (``prefix``) plus a set past it (``done``), which is what a saved state records. A resumed
    epoch starts drawing at ``start`` and passes over the positions in ``consumed_past`` without
    sending them.
    """

    __slots__ = ("count", "done", "log", "next", "of_seq", "prefix", "skip")

    def __init__(self, start: int = 0, consumed_past: tuple[int, ...] | list[int] = ()) -> None:
        self.next = start  # sampler position of the next index drawn
        self.count = start  # batches consumed (yielded, or raised; never produced again)
        self.skip = set(consumed_past)  # consumed before a resume: drawn, never sent
        self.prefix = start  # in_order=False: positions below it are all consumed ...
        self.done = set(self.skip)  # ... and these past it
        self.of_seq: list[int] = []  # in_order=False: task seq -> sampler position
        # in_order=False: positions consumed, latest last, while a consumer holds batches taken
        # ahead of its user (a DevicePrefetcher)
        self.log: deque[int] | None = None

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

    def record(self, in_order: bool, behind: int = 0) -> tuple[int, list[int]]:
        """What a saved state records: the consumed prefix, and the positions past it; as of
        ``behind`` consumed batches ago."""
        if in_order:
            return (self.count - behind, [])
        if not behind:
            return (self.prefix, sorted(self.done))
        back = set(last_logged(self.log, behind))
        low = min(min(back), self.prefix)
        done = {p for p in range(low, self.prefix) if p not in back} | (self.done - back)
        return (low, sorted(done))

    def consumed(self, seq: int) -> None:
        """in_order=False: the batch of task ``seq`` was consumed."""
        pos = self.of_seq[seq]
        if self.log is not None:
            self.log.append(pos)
        if pos != self.prefix:
            self.done.add(pos)
            return
        self.prefix += 1
        while self.prefix in self.done:
            self.done.discard(self.prefix)
            self.prefix += 1
