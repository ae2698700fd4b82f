"""What ``next()`` does in the main process: the per-batch path of a multi-process iterator, in
the order a batch takes it.

    __next__ -> _next_batch: drain dead leases (slots back to dispatch)
        -> until the batch wanted is answered: _receive (one poll, one read per wake-up)
           -> _handle each frame (READY / FAILED / DROPPED / NEED_SLOT / EXHAUSTED / REPLICA)
        -> _process: record it consumed, _try_put the next index (torch's moment), then
           Leases.open (views from the slot's template) -> pin -> user

The iterator's start, epochs and resume record are :mod:`shmloader.epoch`'s
(``ShmDataLoaderIter`` extends this class); the decisions about tasks and slots are
:class:`~shmloader.dispatch.Dispatch`'s.

Invariants:
- Safe places (:mod:`shmloader.interrupts`): an exception leaving ``next()`` from the wait,
  between two frames, the sampler's draw or the rebuild of the batch returned changes nothing
  (``_safe``, ``Supervisor.polling``); from anywhere else it makes the iterator unusable
  (``_left``), its workers stopped and its slots reclaimed, and ``iter(loader)`` starts over.
- Every wait has a deadline: the user's ``timeout``, else ``WAIT_SLICE_S`` slices in which a dead
  worker still wakes the wait at once and fails the iterator (``_fail``).
"""

from __future__ import annotations

import os
import sys
import time
from collections import deque
from typing import Any

from shmloader import protocol as P
from shmloader import rngstate
from shmloader._torch_compat import _BaseDataLoaderIter, profiler_enabled
from shmloader.dispatch import Dispatch
from shmloader.ending import Ending
from shmloader.host import ArenaHost
from shmloader.interrupts import DESIGNED, touched_the_books, unusable_after
from shmloader.lease import Leases
from shmloader.notes import frameless, reraise
from shmloader.onethread import one_thread
from shmloader.progress import SamplerProgress, WorkerProgress
from shmloader.reorder import TaskInfo
from shmloader.supervisor import Supervisor, WorkerDeath


class SamplerRaised:
    """What the sampler raised at a draw :meth:`NextBatch._draw_ahead` made again: raised at
    that draw's turn, as the saved run's was, holding no frame (:func:`frameless`)."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException, handled: BaseException | None) -> None:
        self.error = frameless(
            error, "raised by the sampler when the resumed epoch drew again, as it began, the "
            "indices the saved run had drawn ahead of its save", handled
        )


# A tuple: `P.Ready | P.Failed` would build a union per frame. DROPPED answers only a task the
# main process denied (the worker acknowledges the DENY, its RNG snapshot published).
_ANSWERS = (P.Ready, P.Failed, P.Dropped)
WAIT_SLICE_S = 5.0  # longest single wait when no timeout is set (deaths still wake it at once)


class NextBatch(_BaseDataLoaderIter):
    """The per-batch path; the state it works on is set up by ``ShmDataLoaderIter``."""

    _host: ArenaHost
    _leases: Leases
    _sup: Supervisor
    _dispatch: Dispatch
    _progress: WorkerProgress  # the workers' resume records
    _at: SamplerProgress  # where the epoch's sampler stands
    _rngs_before: deque[bytes] | None  # global RNGs before each consumed batch's draw
    # A resumed epoch's draws that the saved run had made ahead of its save: the RNGs each
    # started from, or (those RNGs, the index drawn, its sampler position) once made again
    _rewound: deque[bytes | tuple[bytes, Any, int]]
    _ending: Ending  # stops the workers, queues every slot for release (shmloader.ending)
    _pid: int  # the process the iterator belongs to
    _ended: bool  # the epoch has ended (StopIteration raised)
    failure: str | None  # why the iterator is unusable; None while it is usable
    _safe: bool  # whether an interruption of next() now leaves nothing half done
    ahead: int  # batches a consumer (a DevicePrefetcher) holds unseen (shmloader.unseen)
    _count_unseen: bool  # a batch handed out counts as held unseen (shmloader.unseen)
    _torn_by_fork = False  # inherited half-way through another thread's step (onethread)

    def __next__(self) -> Any:
        # torch's __next__ wraps every batch in a profiler range, which costs about 10 us even
        # when no profiler runs. Use it whenever it can matter (a profiler is on, the sampler
        # needs a reset, an IterableDataset length warning may be due); else skip the range.
        if (
            profiler_enabled()
            or self._sampler_iter is None
            or self._IterableDataset_len_called is not None
        ):
            return super().__next__()
        data = self._next_data()
        self._num_yielded += 1
        return data

    @one_thread("next()")
    def _next_data(self) -> Any:
        try:
            return self._next_batch()
        except BaseException as e:
            self._left(e, "next()")
            raise

    def _left(self, e: BaseException, where: str) -> None:
        """``e`` is leaving ``where`` (``next()``, ``iter()``, ``state_dict()``): from a safe
        place, or as one of our own errors, it changes nothing; else the iterator is unusable
        (shmloader.interrupts)."""
        safe = self._safe or self._sup.polling or isinstance(e, DESIGNED)
        self._safe = self._sup.polling = False
        if not safe and self.failure is None:
            self.failure = unusable_after(e, where)
            if touched_the_books(e):
                self._host.retired = True  # the arena's books may be half-changed too
                self._host.superseded = False  # (and it lends nothing more: ArenaHost.lenders)
            self._sup.kill()
            self._shutdown_workers()

    def _next_batch(self) -> Any:
        self._safe = False  # from here on an interruption may leave a change half done
        self._check_usable()
        if self._pid != os.getpid():  # inherited through fork(): workers and slots are not ours
            self._safe = True
            raise RuntimeError(
                f"this DataLoader iterator belongs to process {self._pid}, not to this one "
                f"({os.getpid()}), which inherited it through fork(); call iter(loader) here "
                "to iterate with this process's own workers and arena"
            )
        d, leases = self._dispatch, self._leases
        if (leases.dead or leases.fence) and leases.drain():
            d.offer()  # slots of batches whose views died (and whose copies ended) since then
        if d.detach_later:
            d.detach_deferred()  # slabs given back while another thread was inside this one
        while True:
            info = d.next_answer(d.status.__getitem__)
            if info is not None:
                return self._process(info)
            if not d.pending(d.status.__getitem__):
                self._ended = True
                if not self._persistent_workers:
                    self._ending()
                    self._leases.drain()
                raise StopIteration
            self._receive()

    def _receive(self) -> None:
        """Wait for worker frames (unless some read before an interruption are still in the
        inbox) and handle every one of them. Safe to interrupt only in the wait and between
        frames (``_safe``); it returns with ``_safe`` false, as it found it."""
        self._safe = False
        d, inbox = self._dispatch, self._sup.inbox
        deaths: list[WorkerDeath] = []
        deadline = time.monotonic() + self._timeout if self._timeout > 0 else None
        while not inbox and not deaths:
            d.offer()  # slots freed by answers (spares, failures) since the last wait
            blocked = d.blocked_on(d.status.__getitem__)
            if blocked is not None:
                d.unblock(blocked[0], deadline, must=blocked[1])
            # Slices of WAIT_SLICE_S at most, timeout or not: one that ends with nothing read
            # looks at every worker (an exit nothing signalled: no pidfds, review 47)
            left = WAIT_SLICE_S if deadline is None else deadline - time.monotonic()
            if left <= 0:
                why = d.why_waiting(self._timeout)  # the copy fence, or the cap, held it up
                self._safe = True
                raise RuntimeError(f"DataLoader timed out after {self._timeout} seconds{why}")
            deaths = self._sup.wait(min(left, WAIT_SLICE_S))
        while inbox:  # one frame at a time: an interruption leaves the rest for the next call
            self._safe = False
            wid, frame = inbox.popleft()
            self._handle(wid, P.decode(frame))  # type: ignore[arg-type]
        self._safe = False
        if deaths:
            self._fail(deaths)

    def _handle(self, wid: int, msg: P.ToMain) -> None:
        """Record one frame; once it is recorded, an interruption leaves nothing half done."""
        d = self._dispatch
        if isinstance(msg, P.ReplicaState):
            self._progress.replica_state(msg, d.epoch)
        elif msg.epoch != d.epoch:
            d.orphan_answered(msg)
            if not isinstance(msg, P.NeedSlot):
                self._progress.moved_past(wid, msg.epoch, msg.seq)
        else:
            info = d.tasks.get(msg.seq)
            if info is None or (isinstance(msg, P.Dropped) and msg.seq not in d.denied):
                raise RuntimeError(
                    f"unexpected {type(msg).__name__} for task {msg.seq} from worker {wid}"
                )
            if isinstance(msg, _ANSWERS):
                d.answer(info, msg)
            elif isinstance(msg, P.NeedSlot):
                d.need(info, msg)
            else:  # Exhausted: torch marks the worker unavailable, then tries to send one more
                d.retire(wid, info)
                if not self._persistent_workers:
                    self._sup.retire(wid)
                self._try_put()
        self._safe = True  # between frames (shmloader.interrupts)

    def _process(self, info: TaskInfo[Any]) -> Any:
        d = self._dispatch
        self._at.count += 1  # taken from the table: yielded or raised, never produced again
        if self._count_unseen:  # to a consumer that says later how many it holds unseen
            self.ahead += 1
        try:
            self._progress.consumed(info.worker_id, d.epoch, info.seq)
            if not d.in_order:
                self._at.consumed(info.seq)
            d.num_tasks[info.worker_id] -= 1
            # torch draws the next index before it hands this batch out
            if self._rngs_before is None and not self._rewound:
                self._try_put()
            else:  # a DevicePrefetcher may ask for a state behind, or a resumed one is
                self._try_put_rewindable()
        except BaseException:  # the sampler raised (or Ctrl-C): torch drops the batch
            d.release(info.slots())
            raise
        answer = info.answer
        if isinstance(answer, P.Failed):
            d.release(info.slots())
            self._safe = True
            reraise(answer.error)
        self._safe = True  # an interruption from here on drops this batch, and nothing else
        batch = self._leases.open(answer)  # type: ignore[arg-type]  # releases the slot if the batch cannot be rebuilt
        host = self._host
        if host.export is not None:
            host.export.tick(host.snapshot)
        return host.pinner.pin(batch)

    def _try_put_rewindable(self) -> None:
        """:meth:`_try_put` for a consumed batch when the global RNGs it starts from matter to a
        state: logged for a state saved behind a DevicePrefetcher (``rewound_rngs``); and for a
        draw the saved run had made ahead of its save, the index :meth:`_draw_ahead` drew, or a
        draw made now from the RNGs it started from, leaving the global RNGs as they are (the
        saved run's draws since, the training loop's included, are in the state's ``main_rng``;
        review 74). One entry per attempt, as the saved run logged them: an attempt the sampler
        raises from uses its entry up too."""
        rewound = self._rewound.popleft() if self._rewound else None
        log = self._rngs_before
        if isinstance(rewound, tuple):
            rng, index, position = rewound
            if log is not None:
                log.append(rng)
            if type(index) is SamplerRaised:
                error = index.error
                rewound = index = None  # no local of this frame holds the error: no cycle
                self._safe = True  # as the sampler's own raise in _try_put: drops this batch
                try:
                    raise error
                finally:
                    del error
            self._put(index, position)
            return
        if log is not None:
            log.append(rngstate.capture() if rewound is None else rewound)
        if rewound is None:
            self._try_put()
            return
        with rngstate.set_to(rewound):
            self._try_put()

    def _draw_ahead(self) -> None:
        """As a resumed epoch starts, right after the draws priming it: make again, each from the
        RNGs it started from, the draws the saved run had made ahead of its save (``_rewound``),
        and keep their indices for the consumed batches whose turn sends them. So the sampler
        and its generators stand where the saved run's stood at its save even if this epoch is
        left at once (review 74: a ``generator`` that a sampler draws from as it goes stayed
        behind, and the next epoch's batches differed). Each index is kept as its worker will
        receive it (:func:`~shmloader.protocol.as_received`: a batch sampler may refill the
        list it yielded at its next draw; review 74). What the sampler raises at a draw is
        raised at that draw's turn (:class:`SamplerRaised`); from a draw the sampler raises or
        ends at, the rest are made at their turns."""
        pending: deque[Any] = self._rewound
        drawn: list[tuple[bytes, Any, int]] = []
        handled = sys.exc_info()[1]  # (iter() called while the user handles an exception)
        while pending and type(pending[0]) is bytes:
            rng = pending[0]
            try:
                with rngstate.set_to(rng):
                    index = self._at.draw(self._next_index)
            except StopIteration:
                break
            except (KeyboardInterrupt, SystemExit):
                raise
            except BaseException as e:  # noqa: BLE001  (the sampler's: raised at its turn)
                pending.popleft()
                drawn.append((rng, SamplerRaised(e, handled), self._at.next - 1))
                break
            pending.popleft()
            drawn.append((rng, P.as_received(index), self._at.next - 1))
        pending.extendleft(reversed(drawn))

    def _try_put(self) -> None:
        self._safe = True  # the sampler (user code): what it raises drops one index, as in torch
        try:
            index = self._at.draw(self._next_index)
        except StopIteration:
            self._safe = False
            return
        self._safe = False
        # (_put's lines, not a call to it: one call less on every batch's path)
        d = self._dispatch
        sent = d.tasks.sent
        d.put(index)
        if not d.in_order and d.tasks.sent != sent:  # the sampler position each task came from
            self._at.of_seq.append(self._at.next - 1)

    def _put(self, index: Any, position: int) -> None:
        """Decide (and send) the task of the index drawn at sampler ``position``."""
        d = self._dispatch
        sent = d.tasks.sent
        d.put(index)
        if not d.in_order and d.tasks.sent != sent:  # the sampler position each task came from
            self._at.of_seq.append(position)

    def _fail(self, deaths: list[WorkerDeath]) -> None:
        first = deaths[0]
        self.failure = first.describe() + (
            f"(shmloader worker {first.worker_id} of {self._num_workers}; the iterator has been "
            "shut down and its slots reclaimed; iterating the DataLoader again starts fresh "
            "workers)"
        )
        self._sup.kill()  # the iterator is dead: no graceful wait for busy survivors
        self._shutdown_workers()
        raise RuntimeError(self.failure)

    def _shutdown_workers(self) -> None:
        self._ending()
        if self.here:
            self._leases.drain()

    def _check_usable(self) -> None:
        if self.failure is not None:
            raise RuntimeError(f"this DataLoader iterator is unusable: {self.failure}")

    def _busy_here(self) -> bool:
        """Whether this thread holds the lease or arena lock (taken only after this one's)."""
        return self._leases.locked_here()

    @property
    def here(self) -> bool:
        """Whether this iterator belongs to the calling process (not inherited by fork)."""
        return self._pid == os.getpid()
