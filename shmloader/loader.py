"""``shmloader.DataLoader``: torch's DataLoader front end with a shared-memory multi-process path.

The class subclasses ``torch.utils.data.DataLoader``, so construction, argument validation (with
torch's wording and warnings), the attributes torch forbids re-assigning, ``len()``, samplers,
``persistent_workers`` handling and the whole ``num_workers=0`` path are torch's own. Only the
multi-process iterator is replaced (:class:`shmloader.epoch.ShmDataLoaderIter`). This module holds
no data-path logic.

Extra keyword-only arguments (validated once, by :func:`shmloader.options.arena_options`):
- ``arena_backend``: ``"auto"`` (default: POSIX ``/dev/shm`` when it fits, else memfd),
  ``"posix"`` or ``"memfd"``.
- ``arena_max_bytes``: cap on the arena's shared memory (default: half the available RAM).
- ``arena_slots_per_slab``: slots in each new slab (default ``prefetch_factor * num_workers + 1``:
  the batch the user holds, the one being handed over, and the other tasks in flight; the task
  sent while those are all busy gets its slot the moment the user drops the previous batch).
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any, SupportsIndex, TypeVar

import torch.utils.data

from arena import Backend
from arena.finalizers import run_skipped
from shmloader import rngstate
from shmloader import state as S
from shmloader.epoch import ShmDataLoaderIter
from shmloader.host import ArenaHost
from shmloader.onethread import inside, reentered, reset_after_fork
from shmloader.options import arena_options
from shmloader.single import OwedDraws, SingleProcessIter, thread_token
from shmloader.stats import LoaderStats, dist_rank, no_arena

T_co = TypeVar("T_co", covariant=True)


class DataLoader(torch.utils.data.DataLoader[T_co]):
    """Drop-in ``torch.utils.data.DataLoader``; see the module docstring for the extras."""

    def __init__(
        self,
        dataset: torch.utils.data.Dataset[T_co],
        batch_size: int | None = 1,
        shuffle: bool | None = None,
        sampler: torch.utils.data.Sampler[Any] | Iterable[Any] | None = None,
        batch_sampler: torch.utils.data.Sampler[list[Any]] | Iterable[list[Any]] | None = None,
        num_workers: int = 0,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        pin_memory: bool = False,
        drop_last: bool = False,
        timeout: float = 0,
        worker_init_fn: Callable[[int], None] | None = None,
        multiprocessing_context: Any = None,
        generator: Any = None,
        *,
        prefetch_factor: int | None = None,
        persistent_workers: bool = False,
        pin_memory_device: str = "",
        in_order: bool = True,
        arena_backend: Backend | str = Backend.AUTO,
        arena_max_bytes: SupportsIndex | None = None,
        arena_slots_per_slab: SupportsIndex | None = None,
    ) -> None:
        self.arena_options = arena_options(arena_backend, arena_max_bytes, arena_slots_per_slab)
        # As given, under their argument names: code that rebuilds a DataLoader from its
        # attributes (Lightning's sampler injection) passes them on.
        self.arena_backend = arena_backend
        self.arena_max_bytes = arena_max_bytes
        self.arena_slots_per_slab = arena_slots_per_slab
        self._epochs_started = 0  # epochs begun by this loader's iterators (or a loaded state)
        self._plan: dict[str, Any] | None = None  # a loaded state the next iterator resumes
        # What the latest resumed num_workers=0 epoch may still owe the saved run's sampler
        # when the next iterator is made (shmloader.single.OwedDraws)
        self._owed: OwedDraws | None = None
        self._live: Callable[[], Any] | None = None  # the latest iterator (a weak reference)
        # The arena this loader keeps across iterators (made by the first multi-worker iter()).
        self._host: ArenaHost | None = None
        self._consumer_holds = 1  # batches the consumer keeps at once (_consumer_will_hold)
        # iter(), state_dict() and load_state_dict(), one thread at a time (_one_at_a_time)
        self._state_lock = threading.RLock()
        reset_after_fork(self)
        super().__init__(
            dataset,
            batch_size=batch_size,
            shuffle=shuffle,
            sampler=sampler,
            batch_sampler=batch_sampler,
            num_workers=num_workers,
            collate_fn=collate_fn,
            pin_memory=pin_memory,
            drop_last=drop_last,
            timeout=timeout,
            worker_init_fn=worker_init_fn,
            multiprocessing_context=multiprocessing_context,
            generator=generator,
            prefetch_factor=prefetch_factor,
            persistent_workers=persistent_workers,
            pin_memory_device=pin_memory_device,
            in_order=in_order,
        )

    def _get_iterator(self) -> Any:
        self._make_owed()
        plan, self._plan = self._plan, None
        started = self._epochs_started
        try:
            if self.num_workers == 0:
                it: Any = SingleProcessIter(self, plan)
            else:
                self.check_worker_number_rationality()
                it = ShmDataLoaderIter(self, self._host_for, plan)
        except S.StateMismatch:
            raise  # a state this loader cannot resume from: the next iter() starts afresh
        except BaseException:
            if plan is not None:  # no batch came from it: the next iter() resumes from the state
                self._plan = plan
                self._epochs_started = started  # ... and counts that epoch then (review 75)
            raise
        if isinstance(it, SingleProcessIter):
            self._owed = it.owed()
        self._live = weakref.ref(it)
        if self._consumer_holds > 1:
            it.rewindable(self._consumer_holds)
        return it

    def _make_owed(self, iterating: bool = True) -> None:
        """Make the sampler draws a resumed ``num_workers=0`` epoch still owes the saved run
        (:class:`~shmloader.single.OwedDraws`): before the next iterator draws, or a state
        takes where the next epoch's draws start (``iterating=False``), that only on the thread
        whose ``iter()`` made the resumed iterator: the draws set the process's global RNGs for
        their length, which another thread's own draws would see (review 78: a checkpoint
        thread's state_dict() disturbed the training thread's); a state another thread takes
        then records the next epoch's start without them (README)."""
        owed = self._owed
        if owed is None or not (iterating or owed.thread() is thread_token()):
            return
        self._owed = None
        try:
            owed.make()
        except BaseException:
            self._owed = owed  # (a Ctrl-C in a draw: the rest still owed; review 77)
            raise

    def _current(self) -> Any:
        """The latest iterator (a multi-worker one inherited through fork is the parent's: its
        workers and slots are; a num_workers=0 one goes on in an os.fork() child)."""
        it = self._live() if self._live is not None else None
        if isinstance(it, ShmDataLoaderIter) and not it.here:
            return None
        return it

    @contextlib.contextmanager
    def _one_at_a_time(self, what: str) -> Iterator[None]:
        """Run ``iter()``, ``state_dict()`` or ``load_state_dict()`` alone: a checkpoint thread's
        ``state_dict()`` waits while the training thread is inside ``iter()`` (the epoch is
        counted, the plan taken and the iterator made there, one after the other), as an
        iterator's ``state_dict()`` part waits while ``next()`` runs (review 45). Called again
        on a thread already inside one of them, or inside the iterator's ``next()`` (from a
        sampler, a dataset's ``__len__``, a signal handler), it raises instead of reading a
        half-made change, waiting for itself, or waiting for a checkpoint thread that holds
        this lock and waits for the iterator's (review 47). The wait has no timeout of its
        own: ``iter()`` ends with its workers started or with an error (each step of that has
        its own), as ``next()`` ends with a batch, an error or the loader's ``timeout``."""
        lock = self._state_lock
        it = self._current()
        if lock._is_owned() or (it is not None and inside(it)):  # type: ignore[attr-defined]
            raise reentered(what)
        with lock:
            yield

    def state_dict(self) -> dict[str, Any]:
        """Where this loader is: load it into a fresh loader (``load_state_dict``) to get the
        batches an uninterrupted run yields next. Small, picklable, ``torch.save``-able; see
        :mod:`shmloader.state` for its fields. Any thread may call it while another iterates:
        it waits for the ``iter()`` or ``next()`` under way, and describes the loader as that
        call left it (but for one case, with ``num_workers=0``: between a resumed epoch left
        before it made again every draw its state rewound and the next ``iter()``, a state
        taken on another thread than the one whose ``iter()`` made that epoch records the next
        epoch's start without those draws; see :meth:`_make_owed`)."""
        with self._one_at_a_time("state_dict()"):
            it = self._current()
            if self._plan is not None:  # loaded, not iterated yet: the state it loaded
                body: dict[str, Any] | None = {
                    **{k: self._plan[k] for k in S.ITER_KEYS},
                    # and the draws it has yet to make again (review 74)
                    "rewound_rngs": list(self._plan.get("rewound_rngs") or ()),
                }
            else:
                self._check_not_inherited_mid_epoch()
                # The iterator decides under its own lock whether its epoch is over (a next()
                # in another thread may end it meanwhile), and takes the main process's RNGs
                # there too, so that no sampler draw or fetch falls between the two.
                body = it.resume_state() if it is not None else None
            if body is None:  # no iterator, or one whose epoch ended (not persistent)
                body = {
                    "epoch": self._epochs_started, "in_epoch": False, "yielded": 0,
                    "yielded_extra": [], "base_seed": None, "epoch_start": None,
                    "workers": [], "replicas": None,
                }  # fmt: skip
            if body["epoch_start"] is None:  # between epochs: where the next epoch's draws start
                self._make_owed(iterating=False)  # (after those the last epoch owed: review 77)
                body["epoch_start"] = S.EpochStart.capture(self).as_dict()
            main_rng = body.pop("main_rng", None)
            rewound = body.pop("rewound_rngs", [])
            return {
                "format": S.FORMAT,
                "version": S.VERSION,
                "fingerprint": S.fingerprint(self),
                **body,
                "main_rng": rngstate.capture() if main_rng is None else main_rng,
                "rewound_rngs": rewound,
            }

    def _check_not_inherited_mid_epoch(self) -> None:
        """A multi-worker iterator inherited through fork() in the middle of its epoch (or with
        persistent workers, whose random streams go on) is the parent's: where it stands is in
        the parent's workers, pipes and RNG ring, which move on without this process. Its
        state here would say the epoch had ended (review 48), so a resume skipped the rest."""
        it = self._live() if self._live is not None else None
        if not isinstance(it, ShmDataLoaderIter) or it.here:
            return
        # Over as resume_state() decides: not while a DevicePrefetcher holds some of its
        # batches, or its end, unseen (review 56).
        over = it._epoch_over()
        if over and not it._persistent_workers:
            return  # nothing of the parent's in the state
        where = "kept its workers (persistent_workers=True)" if over else "was mid-epoch"
        raise RuntimeError(
            "state_dict() in a process that inherited this DataLoader through fork() while its "
            f"{it._num_workers}-worker iterator (of process {it._pid}) {where}: where that "
            "epoch stands is in the parent's workers and their RNG snapshots, which move on "
            "without this process. Take loader.state_dict() in the parent (before forking, and "
            "pass it on), or call iter(loader) here first to iterate with this process's own "
            "workers."
        )

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume from ``state_dict()`` of a loader built the same way (any process): the next
        ``iter()`` yields what the saved loader would have yielded next. Also sets this process's
        global torch, ``random`` and NumPy RNGs to their state at ``state_dict()``."""
        with self._one_at_a_time("load_state_dict()"):
            it = self._current()
            # An iterator that failed (a worker died; its state_dict() says why) is replaced by the
            # next iter() anyway: loading the last good state into its loader is the way back.
            if it is not None and not it._ended and getattr(it, "failure", None) is None:
                raise RuntimeError(
                    "load_state_dict() called while this DataLoader is being iterated (an iterator "
                    "of it is mid-epoch): load the state before iterating, into a fresh DataLoader"
                )
            sd = S.check(self, state_dict)
            # An idle persistent iterator is let go before its workers stop: an interruption
            # between the two must not leave the loader reusing an iterator whose pipes are closed.
            old, self._iterator, self._live = self._iterator, None, None
            if isinstance(old, ShmDataLoaderIter):
                old._shutdown_workers()
            self._owed = None  # the state loaded supersedes what an earlier one owed (review 77)
            if not sd["in_epoch"]:
                S.EpochStart.from_dict(sd["epoch_start"]).apply(self)
            rngstate.restore(sd["main_rng"])
            self._epochs_started = sd["epoch"]
            self._plan = sd if (sd["in_epoch"] or sd["base_seed"] is not None) else None

    def _host_for(self, pin: bool, pin_device: str | None) -> ArenaHost:
        """This loader's arena in this process: made on first use, and made anew in a process
        other than the one that made it (a fork of the main process), never shared, once an
        interruption may have left it half-changed (``retired``), or when the iterator asks for
        other pinning than it was made with (``pin_memory`` changed between iterators)."""
        self._finish_cut_short()
        old = self._host
        if old is not None and old.here and old.pin_setting != (pin, pin_device):
            # pin_memory (or its device) changed since: torch's next iterator reads it anew. The
            # old arena is let go as a retired one is: its batches stay valid and counted, and
            # its iterators may run on (release() and a DevicePrefetcher still reach it).
            old.superseded = old.retired = True
        if old is None or not old.here or old.retired:
            opts = self.arena_options
            old = self._host = ArenaHost(
                backend=opts.backend,
                max_bytes=opts.max_bytes,
                slots_per_slab=opts.slots_per_slab or self._default_slots_per_slab(),
                pin=pin,
                pin_device=pin_device,
                # A retired host's held batches (and the hosts before it) count on in stats().
                predecessors=old.succession() if old is not None and old.here else (),
            )
        return old

    def _finish_cut_short(self) -> None:
        """Finish what interruptions cut short: finalizers whose object died without them
        running (:mod:`arena.finalizers`: a dropped loader's arena, a slab's mapping), and
        endings of this loader's iterators (:mod:`shmloader.ending`)."""
        run_skipped()
        if self._host is not None:
            self._host.end_pending()

    def _default_slots_per_slab(self) -> int:
        """A slot for each batch the workers may have in flight, plus those the consumer holds
        at once (one, unless a :class:`~shmloader.DevicePrefetcher` said it holds more)."""
        nw = self.num_workers
        return (self.prefetch_factor or 2) * nw + self._consumer_holds

    def _consumer_will_hold(self, batches: int) -> None:
        """The consumer keeps up to ``batches`` batches alive at once (a ``DevicePrefetcher`` of
        depth d: d + 2). New slabs get a slot for each, unless ``arena_slots_per_slab`` was
        given; without them the workers would wait for slots the consumer holds."""
        self._consumer_holds = max(self._consumer_holds, batches)
        it = self._current()
        if it is not None:
            it.rewindable(batches)  # state_dict() rewinds the batches it holds unseen
        host = self._host
        if host is not None and host.here and not self.arena_options.slots_per_slab:
            host.arena.slots_per_slab = max(host.arena.slots_per_slab,
                                            self._default_slots_per_slab())

    def __iter__(self) -> Any:
        with self._one_at_a_time("iter()"):
            # A persistent iterator whose workers died or were stopped, or one inherited
            # through fork() (its workers are the parent's), is replaced instead of reset.
            it = self._iterator
            if isinstance(it, ShmDataLoaderIter) and (
                it.failure is not None or not it.here or it._sup.stopped
            ):
                self._iterator = None
            return super().__iter__()

    def __getstate__(self) -> dict[str, Any]:
        # A loader pickled into another process takes no arena, iterator or workers along.
        state = self.__dict__.copy()
        state["_host"] = None
        state["_iterator"] = None
        state["_live"] = None
        state["_owed"] = None
        del state["_state_lock"]  # a lock does not pickle: the copy makes its own
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._state_lock = threading.RLock()
        reset_after_fork(self)

    def stats(self) -> LoaderStats:
        """Arena bytes and slots by state, batches held by the user, pinned bytes, worker pids
        (fields: :class:`LoaderStats`); before the first multi-worker iterator in this process,
        and always with ``num_workers=0``, nothing is reserved and ``backend`` is ``"none"``."""
        rank, world = dist_rank()
        host = self._host  # once: iter() in another thread may replace it meanwhile
        if host is None or not host.here:
            st = no_arena(self.arena_options.planned_max_bytes() if self.num_workers else 0)
        else:
            self._finish_cut_short()
            st = host.snapshot()  # with what retired hosts hold (ArenaHost.retired_held)
        if (rank, world) == (0, 1):
            return st
        return dataclasses.replace(st, rank=rank, world_size=world)
