"""The ``num_workers=0`` iterator: torch's own, plus what ``DataLoader.state_dict()`` needs.

Batches, RNG use and timing are torch's ``_SingleProcessDataLoaderIter``'s; this subclass only
records where the epoch's sampler draws started (:class:`shmloader.state.EpochStart`), counts
the epoch, and on a resumed state replays the sampler's draws and skips the batches already
consumed without fetching them. With no workers the dataset draws from the main process's
global RNGs, which the state carries as ``main_rng``.

An IterableDataset has no sampler to skip: a dataset with ``state_dict`` / ``load_state_dict``
is loaded with its saved state before ``iter()``; any other is fast-forwarded (the batches
already consumed are fetched again and dropped, with the global RNGs put back afterwards).
"""

from __future__ import annotations

import copy
import threading
import weakref
from collections import deque
from typing import Any

import torch

from shmloader import rngstate
from shmloader._torch_compat import ITERABLE_KIND
from shmloader.collate import private_default_collate
from shmloader.onethread import one_thread, reset_after_fork
from shmloader.progress import last_logged
from shmloader.state import EpochStart, is_stateful, skip_consumed, untouched_rngs
from shmloader.unseen import HeldUnseen

_SingleProcessDataLoaderIter = torch.utils.data.dataloader._SingleProcessDataLoaderIter


class SingleProcessIter(_SingleProcessDataLoaderIter, HeldUnseen):
    _torn_by_fork = False  # inherited half-way through another thread's step (onethread)

    def __init__(self, loader: Any, plan: dict[str, Any] | None = None) -> None:
        # next() and state_dict() one thread at a time: a checkpoint thread's state waits for
        # the fetch under way (the sampler draws and the dataset's global RNG draws of a batch
        # are either all in the state or none of them; review 45)
        self._lock = threading.RLock()
        reset_after_fork(self)
        self._reset_unseen()  # what a DevicePrefetcher pass holds unseen (shmloader.unseen)
        self._consumed = 0
        # While a DevicePrefetcher holds batches unseen: the global RNGs before each fetch, so
        # that a state saved behind them resumes from before their draws (rewindable()).
        self._rngs_before: deque[bytes] | None = None
        # A resumed epoch's fetches that a state saved behind a DevicePrefetcher rewound: the
        # global RNGs before each, as they were in the saved run (resume_state()); or, once its
        # index was drawn because another epoch began first (OwedDraws), those RNGs, the index,
        # and the RNGs after the draw.
        self._rewound: deque[bytes | tuple[bytes, Any, bytes]] = deque()
        self._drawn: tuple[Any] | None = None  # the index the next _next_index() returns
        resumed = plan is not None and plan["in_epoch"]
        replica = plan["replicas"]["workers"][0] if resumed and plan["replicas"] else None  # type: ignore[index]
        if replica is not None and "state" in replica:
            # before iter(dataset); a copy, as the plan stays for the next iter() if this fails
            loader.dataset.load_state_dict(copy.deepcopy(replica["state"]))
        if not resumed:
            # Before torch's __init__: a sampler may draw in iter() (an eager permutation), which
            # that __init__ calls before it draws the base seed (shmloader.state.EpochStart).
            self.epoch_start = EpochStart.capture(loader, before_init=True)
            self._torch_init(loader)
            self._counted(loader, 0)
            return
        assert plan is not None
        self.epoch_start = start = EpochStart.from_dict(plan["epoch_start"])
        if start.before_init:
            # The saved run's __init__, sampler draws and (for an IterableDataset without state)
            # replica fetches, replayed from the epoch's start; the global RNGs are put back.
            with start.replay(loader):
                self._torch_init(loader)
                self._replay(plan, replica)
        else:  # a state saved before EpochStart.before_init: captured after __init__
            with untouched_rngs(loader):
                self._torch_init(loader)
            with start.replay(loader):
                self._sampler_iter = iter(self._index_sampler)
                self._replay(plan, replica)
        self._base_seed = plan["base_seed"]
        self._counted(loader, plan["yielded"])
        self._rewound = deque(plan.get("rewound_rngs") or ())

    def owed(self) -> OwedDraws | None:
        """The draws this resumed epoch still owes the saved run, to be made if another epoch
        begins first (:class:`OwedDraws`); None when it owes none."""
        if not self._rewound or self._dataset_kind == ITERABLE_KIND:
            return None  # (an IterableDataset's sampler draws nothing)
        return OwedDraws(self)

    def _torch_init(self, loader: Any) -> None:
        """Torch's ``__init__``; its fetcher collates with :func:`private_default_collate` in
        place of ``default_collate``, as workers use ``slot_default_collate``: the same batches,
        but a dataset's gathered rows (``shmloader.arrow``) collate themselves."""
        super().__init__(loader)
        fetcher = self._dataset_fetcher
        if fetcher.collate_fn is torch.utils.data.default_collate:
            fetcher.collate_fn = private_default_collate

    def _counted(self, loader: Any, consumed: int) -> None:
        self._ended = False
        self._consumed = consumed  # batches of the epoch drawn: yielded, or raised (never again)
        self.epoch_no = loader._epochs_started
        loader._epochs_started += 1

    def _replay(self, plan: dict[str, Any], replica: dict[str, Any] | None) -> None:
        """Draw the indices of the batches consumed before the save; fast-forward a replica
        without ``state_dict`` past them."""
        skip_consumed(self._next_index, plan["yielded"])
        self._num_yielded = plan["yielded"]
        if replica is not None and "state" not in replica:
            self._fast_forward(replica["batches"])
        elif replica is not None and replica.get("ended"):
            # It ran out inside the last batch consumed: it ends there, whatever its state says.
            self._dataset_fetcher.ended = True

    def _fast_forward(self, batches: int) -> None:
        saved = rngstate.capture()  # the draws of batches already consumed are not replayed
        try:
            for _ in range(batches):
                try:
                    self._dataset_fetcher.fetch(self._next_index())
                except StopIteration:
                    raise
                # It raised in the saved run too, and the user consumed that error: go on.
                except Exception:  # noqa: BLE001
                    continue
        except StopIteration:
            pass
        finally:
            rngstate.restore(saved)

    def _reset(self, loader: Any, first_iter: bool = False) -> None:
        super()._reset(loader, first_iter)
        self._ended = False
        self._consumed = 0
        self._rewound.clear()
        self._drawn = None

    def _next_index(self) -> Any:
        if self._drawn is not None:
            (index,), self._drawn = self._drawn, None
        else:
            index = super()._next_index()  # type: ignore[no-untyped-call]
        self._consumed += 1
        return index

    def _busy_here(self) -> bool:
        return False  # no lower locks: one_thread's re-entrance test is the lock's own

    @one_thread("next()")
    def _next_data(self) -> Any:
        rewound = self._rewound.popleft() if self._rewound else None
        outer = before = None
        if rewound is not None:
            # A fetch the saved run had made ahead, behind a DevicePrefetcher: made again from
            # the global RNGs it started from then (after its index, if OwedDraws drew it), and
            # leaving them as they are (the saved run's draws since, the training loop's
            # included, are in the state's main_rng).
            outer = rngstate.capture()
            if isinstance(rewound, tuple):
                before, index, after = rewound
                self._drawn = (index,)
                rngstate.restore(after)
            else:
                before = rewound
                rngstate.restore(rewound)
        log = self._rngs_before
        if log is not None:
            log.append(rngstate.capture() if before is None else before)
        drawn = self._consumed
        try:
            data = self._fetch_next()
        except BaseException:
            if rewound is not None and self._consumed == drawn:
                self._rewound.appendleft(rewound)  # no batch came of it: the next fetch is it
                self._drawn = None
            raise
        finally:
            if outer is not None:
                rngstate.restore(outer)
        return data

    def _fetch_next(self) -> Any:
        """Torch's ``_next_data``, with the counts a DevicePrefetcher's state needs."""
        log = self._rngs_before
        logged = log is not None
        drawn = self._consumed
        try:
            data = super()._next_data()  # type: ignore[no-untyped-call]
        except BaseException as e:
            if isinstance(e, StopIteration):
                # No batch came of that fetch (an IterableDataset's index was drawn, then its
                # replica ended): it is not counted.
                self._consumed = drawn
                self._ended = True
            # A fetch that used up no batch (that, or a sampler that raised before it drew)
            # keeps no RNG state either: else a state saved behind a DevicePrefetcher takes
            # the RNGs one batch late (review 40).
            if logged and self._consumed == drawn and self._rngs_before:
                self._rngs_before.pop()
            if self._count_unseen and self._consumed != drawn:
                self.ahead += 1  # its error goes to the consumer first (_taken_unseen)
            raise
        if self._count_unseen:
            self.ahead += 1
        return data

    def _batches_taken(self) -> int:
        """Batches of the epoch drawn so far, yielded or raised (for a DevicePrefetcher)."""
        return self._consumed

    @one_thread("state_dict()")
    def resume_state(self) -> dict[str, Any] | None:
        """This iterator's part of ``DataLoader.state_dict()`` (see :mod:`shmloader.state`), as
        of before the batches a consumer took and has not handed out yet (``ahead``: a
        ``DevicePrefetcher``), which a resumed loader fetches again, each from the global RNGs
        as they were before it (``rewound_rngs``), leaving the global RNGs as they are now
        (``main_rng``; review 61: restored to before the first of them, a resumed epoch left
        before fetching them again left every later draw behind); None once the epoch is over
        with none behind (the loader records that)."""
        behind = self.ahead
        if self._epoch_over():
            return None
        return {
            "epoch": self.epoch_no,
            "in_epoch": True,
            "yielded": self._consumed - behind,
            "yielded_extra": [],
            "base_seed": int(self._base_seed),
            "epoch_start": self.epoch_start.as_dict(),
            "workers": [],
            "replicas": self._replicas(behind),
            "main_rng": rngstate.capture(),
            # and the fetches a resumed epoch has yet to make again (review 62: a state saved
            # before they were all made lost them, and the next resume fetched them from the
            # wrong RNGs)
            "rewound_rngs": (
                last_logged(self._rngs_before, behind) if behind else []
            ) + [r if type(r) is bytes else r[0] for r in self._rewound],
        }

    def rewindable(self, batches: int) -> None:
        """Keep the global RNGs before each fetch (at least the last ``batches``; never fewer
        than asked before)."""
        before = self._rngs_before
        asked = 0 if before is None else before.maxlen or 0
        self._rngs_before = deque(before or (), maxlen=max(asked, 64, 2 * batches))

    def _replicas(self, behind: int) -> dict[str, Any] | None:
        if self._dataset_kind != ITERABLE_KIND:
            return None
        entry: dict[str, Any] = {"batches": self._consumed - behind}
        if is_stateful(self._dataset):
            if behind:
                raise RuntimeError(
                    f"cannot save the DataLoader's state: a DevicePrefetcher holds {behind} "
                    "batches taken ahead of you, and with num_workers=0 the dataset's "
                    "state_dict() is already past them; use num_workers > 0 (each batch's "
                    "replica state is kept until it is consumed) or save between epochs"
                )
            # A copy: the dataset may go on changing the dict it returned (the worker path
            # pickles it at once).
            entry["state"] = copy.deepcopy(self._dataset.state_dict())  # type: ignore[attr-defined]
            # It ran out: inside the last batch (torch's fetcher marks itself ended), or, with
            # batch_size=None, at a fetch a DevicePrefetcher made ahead of you, which found the
            # end (review 33) while the epoch is not over for you.
            if self._ended or getattr(self._dataset_fetcher, "ended", False):
                entry["ended"] = True
        return {"workers": [entry], "assign": [], "next_worker": 0}


class OwedDraws:
    """The fetches a resumed ``num_workers=0`` epoch makes again (``rewound_rngs``) draw their
    indices at their turn, as torch does: each index goes to the dataset as the sampler yielded
    it, before the next draw (an index object may be the dataset's key, or refilled by the next
    draw). When the loader's next iterator is made before they are all made (the epoch left at
    the save), the rest are drawn then, each from its RNGs, so the sampler and its generators
    stand where the saved run's stood (review 74: a ``generator`` a sampler draws from as it
    goes stayed behind, and every later epoch differed; review 76: drawn at once as the epoch
    began, they broke index objects). An iterator still alive keeps those indices for its
    fetches. It holds the sampler's iterator, not the iterator (which may be gone by then)."""

    def __init__(self, it: SingleProcessIter) -> None:
        self.sampler_iter = it._sampler_iter
        self.rewound = it._rewound
        self.lock = it._lock
        # The thread whose iter() made it: a token of that thread's own, gone with it (not its
        # id, which a later thread reuses: review 79; nor its Thread object, which a later
        # thread not started by `threading` may be handed again: review 80)
        self.thread = weakref.ref(thread_token())

    def make(self) -> None:
        """Make the draws, unless the iterator is inside a fetch in another thread (it is alive
        and in use there: it makes them itself; review 77: iter() waited for that fetch)."""
        if not self.lock.acquire(blocking=False):
            return
        try:
            self._draw()
        finally:
            self.lock.release()

    def _draw(self) -> None:
        """Each fetch still owed, its index drawn now from the RNGs it started from (and those
        after the draw kept for the fetch), in order, each entry replaced as it is made (a
        Ctrl-C keeps those made, and the rest owed); from a draw the sampler ends or raises
        at, the rest are made at their fetches, if ever."""
        pending: deque[Any] = self.rewound
        for k, rng in enumerate(list(pending)):
            if type(rng) is not bytes:
                continue  # (made already: by a make() a Ctrl-C cut short)
            try:
                with rngstate.set_to(rng):
                    index = next(self.sampler_iter)
                    after = rngstate.capture()
            except Exception:  # noqa: BLE001  (StopIteration, or the sampler's: at its fetch)
                return
            pending[k] = (rng, index, after)


class _Token:
    """A thread's own object (weak references to it die with the thread)."""


_here = threading.local()


def thread_token() -> _Token:
    """This thread's token: the same object for the thread's life, freed when it ends."""
    token = getattr(_here, "token", None)
    if token is None:
        token = _here.token = _Token()
    return token
