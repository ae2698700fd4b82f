"""The worker process: task -> fetch -> collate into the slot -> descriptor.

Loop states (one dispatch over commands)::

    start: seed, init_fn, fetcher --> IDLE
    IDLE --TASK--> FETCH --> PACK --fits its slot--> READY sent --> IDLE
                              |
                              +--overflowed, but fits its slot--> lay out again there --> READY
                              +--no slot / too small--> NEED_SLOT sent --GRANT--> lay out --> READY
                                                                  --DENY / RESUME / STOP--> drop
    IDLE --RESUME--> fresh fetcher --> IDLE      IDLE --stale TASK--> fetch --> DROPPED sent
    any --ATTACH / DETACH--> map / unmap a slab (applied as soon as read; an ATTACH that fails
                             is retried by the next task that names the slab)
    any --REVOKE--> a queued task forgets the slot it was sent with (it asks when it gets there)
    IDLE --STOP or EOF--> exit

A task sent without a slot first takes a GRANT the main process already offered for it, if one
is waiting in the pipe; the default collate *plans* a batch it has no room for (meta tensors)
and collates the same samples again into the granted slot.

Invariants:
- Seeding is torch's: ``seed = base_seed + worker_id`` for ``random`` and torch, NumPy from
  torch's ``_generate_state``; ``get_worker_info()`` is set before ``worker_init_fn`` runs.
- A worker writes only into the slot its current task names or a slot granted for that task.
  Before NEED_SLOT it copies out whatever of the batch lives in the old slot; after it, it never
  touches that slot again (the main process frees it at once).
- Every task sent to a worker is fetched, in order, as torch's workers do (tasks of an abandoned
  epoch too), so dataset-side randomness stays in step with torch; after its IterableDataset
  replica is exhausted the worker skips tasks until RESUME, as torch's do (a skipped task of an
  abandoned epoch is still answered DROPPED, so its slot comes back).
- A slab the worker could not map when its ATTACH came (no descriptor to spare, no address
  space, or the slab already given back) is not given up on: its spec is kept until its DETACH,
  and every task that names it tries to map it again. A task whose slab still cannot be mapped
  fails alone, with the attach error (a shmloader error naming the resource, the numbers and the
  fix), re-raised in the main process at that batch's turn; the next task tries again.
- The worker dies with the main process: a watchdog thread waits on a pidfd of the main process
  and exits the moment it goes. SIGINT is ignored: Ctrl-C is the main process's to handle.
"""

from __future__ import annotations

import contextlib
import gc
import os
import pickle
import random
import select
import signal
import threading
from collections import deque
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import torch

from arena import ArenaError, Descriptor, Slab, SlabSpec, SlotRef
from shmloader import kept
from shmloader import protocol as P
from shmloader._torch_compat import (
    ITERABLE_KIND,
    ExceptionWrapper,
    IterDataPipe,
    WorkerInfo,
    create_fetcher,
    numpy_seed,
    set_worker_info,
    wrap_current_exception,
)
from shmloader.collate import SlotSession, SlotView
from shmloader.frames import FrameReader, framed
from shmloader.kept import HANDED, KeptWatch
from shmloader.pack import Packed, used_bytes
from shmloader.rngstate import RngRing, restore
from shmloader.state import is_stateful


@dataclass(frozen=True)
class WorkerConfig:
    """Everything a worker is started with (pickled once under spawn/forkserver)."""

    worker_id: int
    num_workers: int
    dataset_kind: int
    dataset: Any
    auto_collation: bool
    collate_fn: Any
    drop_last: bool
    base_seed: int
    init_fn: Any
    main_pid: int
    shared_seed: int | None = None
    close_fds: tuple[int, ...] = ()  # inherited main-process pipe ends (fork only)
    rng_ring: SlabSpec | None = None  # where to publish RNG snapshots (shmloader.rngstate)
    rng_depth: int = 0
    # A resumed DataLoader state's RNG: ``rng_epoch_start`` before ``iter()`` of the dataset
    # (where the saved run's worker stood when its epoch began: the state between epochs, or an
    # IterableDataset replica's epoch start, from which a fast-forward replays), ``rng_restore``
    # once the replica is restored (where it stood after its last consumed batch).
    rng_epoch_start: bytes | None = None
    rng_restore: bytes | None = None
    # IterableDataset replica of a resumed epoch: {"batches": consumed, "state": pickled
    # state_dict() or None} (shmloader.progress)
    replica_restore: dict[str, Any] | None = None


class _KeepSamples:
    """The collate_fn handed to torch's fetcher: collates, and keeps the current task's samples
    so a planned batch can be collated again into the slot granted for it."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn
        self.samples: Any = None

    def __call__(self, samples: Any) -> Any:
        self.samples = samples
        kept.collating = True  # shmloader.empty() memory handed out now is watched
        try:
            return self.fn(samples)
        finally:
            kept.collating = False


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _exit_when_main_exits(main_pid: int) -> None:
    try:
        pidfd = os.pidfd_open(main_pid)
    except ProcessLookupError:
        os._exit(1)
    except OSError:  # pidfd unsupported: fall back to polling
        while True:
            try:
                os.kill(main_pid, 0)
            except ProcessLookupError:
                os._exit(1)
            threading.Event().wait(0.2)
    watch = select.poll()  # (not select(): descriptors past 1024 are common in big jobs)
    watch.register(pidfd, select.POLLIN)
    watch.poll()
    os._exit(1)


def _seed(cfg: WorkerConfig) -> int:
    seed = cfg.base_seed + cfg.worker_id
    random.seed(seed)
    torch.manual_seed(seed)
    import numpy as np

    np.random.seed(numpy_seed(cfg.base_seed, cfg.worker_id))
    return seed


class _Worker:
    def __init__(self, cfg: WorkerConfig, conn: Connection) -> None:
        self.cfg = cfg
        self.conn = conn
        self.fd = conn.fileno()
        self.frames = FrameReader(self.fd)
        self.slabs: dict[int, Slab] = {}
        # Slabs announced (ATTACH) but not mapped yet: slab id -> spec, to map when a task names
        # one (until its DETACH).
        self.unattached: dict[int, SlabSpec] = {}
        self.inbox: deque[P.ToWorker] = deque()
        self.iteration_end = False
        self.latest_epoch = 0
        self.grants: dict[tuple[int, int], SlotRef] = {}  # (epoch, seq) -> slot offered
        self.denied: set[tuple[int, int]] = set()  # (epoch, seq) whose batch can never fit
        self.revoked: set[tuple[int, int]] = set()  # (epoch, seq) sent with a slot taken back
        self.views: dict[tuple[int, int], SlotView] = {}  # (slab, slot) -> its views
        self.init_error: ExceptionWrapper | None = None
        self.dataset = cfg.dataset
        self.collator = _KeepSamples(cfg.collate_fn)
        self.kept = KeptWatch(self.where())  # shmloader.empty() memory kept past its batch
        self.fetcher: Any = None
        # An IterableDataset replica with torchdata's Stateful protocol reports its state_dict()
        # after every batch (REPLICA), for DataLoader.state_dict().
        self.stateful = cfg.dataset_kind == ITERABLE_KIND and is_stateful(self.dataset)
        self.rng = None if cfg.rng_ring is None else RngRing.attach(cfg.rng_ring, cfg.rng_depth)

    def where(self) -> str:
        return f"in DataLoader worker process {self.cfg.worker_id}"

    def make_fetcher(self) -> None:
        c = self.cfg
        self.fetcher = create_fetcher(
            c.dataset_kind, self.dataset, c.auto_collation, self.collator, c.drop_last
        )

    def start(self) -> None:
        cfg = self.cfg
        seed = _seed(cfg)
        if isinstance(self.dataset, IterDataPipe) and cfg.shared_seed is not None:
            self._apply_shared_seed(cfg.shared_seed)
        set_worker_info(
            WorkerInfo(
                id=cfg.worker_id, num_workers=cfg.num_workers, seed=seed, dataset=self.dataset
            )
        )
        try:
            if cfg.init_fn is not None:
                cfg.init_fn(cfg.worker_id)
            if cfg.rng_epoch_start is not None:
                restore(cfg.rng_epoch_start)
            restore_replica = cfg.replica_restore
            ended = False
            if restore_replica is not None and restore_replica["state"] is not None:
                self.dataset.load_state_dict(pickle.loads(restore_replica["state"]))
                ended = restore_replica["ended"]
                restore_replica = None
            self.make_fetcher()
            if ended:  # it ran out inside the last batch consumed from it: its next fetch ends
                self.fetcher.ended = True
            if restore_replica is not None:
                self.fast_forward(restore_replica["batches"], restore_replica["index"])
        # User code failed: forward it to the main process, as torch does.
        except Exception:  # noqa: BLE001
            self.init_error = wrap_current_exception(self.where())
        if cfg.rng_restore is not None:
            restore(cfg.rng_restore)  # where the saved run's worker was, after its init

    def fast_forward(self, batches: int, index: Any) -> None:
        """A resumed replica without ``load_state_dict``: fetch the batches the user already
        consumed from this worker again, and drop them (the RNG snapshot is restored after)."""
        for _ in range(batches):
            try:
                with SlotSession(None):
                    self.fetcher.fetch(index)
            except StopIteration:
                self.iteration_end = True
                return
            # It raised in the saved run too, and the user consumed that error: go on past it.
            except Exception:  # noqa: BLE001
                pass
            finally:
                self.collator.samples = None

    def _apply_shared_seed(self, shared_seed: int) -> None:
        from torch.utils.data.graph_settings import apply_random_seed

        rng = torch.Generator()
        rng.manual_seed(shared_seed)
        self.dataset = apply_random_seed(self.dataset, rng)

    def read(self) -> P.ToWorker:
        """The next frame from the pipe (STOP on EOF). ATTACH is applied at once, and a RESUME
        raises ``latest_epoch`` as soon as it is read, so queued tasks know they are stale.

        The wait has no timeout of its own: it ends with a frame, with EOF when the main process
        closes its end, or with the process when the watchdog sees the main process die.
        """
        frame = self.frames.next()
        if frame is None:
            self.inbox.clear()  # the main process closed its end: queued tasks have no reader
            return P.Stop()
        msg = P.decode(frame)
        if isinstance(msg, P.Attach):
            try:
                self.attach(msg.spec)
            except (OSError, ArenaError):
                if not _alive(self.cfg.main_pid):
                    return P.Stop()  # the main process is gone: nothing left to load for
                # The arena gave the slab back before this worker got here (its DETACH follows),
                # or this process is short of descriptors or address space for now: a task that
                # names the slab tries again (slot()), and fails alone if it still cannot.
                self.unattached[msg.spec.slab_id] = msg.spec
        elif isinstance(msg, P.Detach):
            self.unattached.pop(msg.slab_id, None)
            slab = self.slabs.pop(msg.slab_id, None)
            for key in [k for k in self.views if k[0] == msg.slab_id]:
                del self.views[key]
            if slab is not None:
                slab.close()
        elif isinstance(msg, P.Grant):
            self.grants[(msg.epoch, msg.seq)] = msg.ref
        elif isinstance(msg, P.Deny):
            self.denied.add((msg.epoch, msg.seq))
        elif isinstance(msg, P.Revoke):
            self.revoked.add((msg.epoch, msg.seq))
            self.grants.pop((msg.epoch, msg.seq), None)
        elif isinstance(msg, P.Resume):
            self.latest_epoch = max(self.latest_epoch, msg.epoch)
            for key in [k for k in self.grants if k[0] < msg.epoch]:
                del self.grants[key]  # grants for tasks of an abandoned epoch
            self.revoked = {k for k in self.revoked if k[0] >= msg.epoch}
        return msg  # type: ignore[return-value]

    def attach(self, spec: SlabSpec) -> Slab:
        """Map ``spec``'s slab (not pre-faulted whole: that would fill slots the main process
        hollowed; each slot is faulted in when first used). Raises what
        :meth:`arena.Slab.attach` raises; then the slab stays unmapped."""
        slab = self.slabs[spec.slab_id] = Slab.attach(spec, populate=False)
        self.unattached.pop(spec.slab_id, None)
        return slab

    def take_grant(self, epoch: int, seq: int) -> SlotRef | None:
        """A slot the main process has already offered for this task, if any (reads whatever
        frames are waiting, without blocking)."""
        while (epoch, seq) not in self.grants and self.frames.ready():
            msg = self.read()
            if not isinstance(msg, P.Attach | P.Detach | P.Grant | P.Deny | P.Revoke):
                self.inbox.append(msg)
        return self.grants.pop((epoch, seq), None)

    def slot(self, ref: SlotRef | None) -> SlotView | None:
        """The slot ``ref`` names, viewed once and reused for every batch written there."""
        if ref is None:
            return None
        key = (ref.slab_id, ref.slot)
        view = self.views.get(key)
        if view is None:
            slab = self.slabs.get(ref.slab_id)
            if slab is None:
                spec = self.unattached.get(ref.slab_id)
                if spec is None:
                    raise RuntimeError(
                        f"a task names slot {ref.slot} of slab {ref.slab_id}, which this worker "
                        "has not mapped: the arena gave the slab back (DETACH) or never "
                        "announced it to this worker"
                    )
                # Its ATTACH failed: try again now. Still failing raises (this task fails with
                # the reason); the spec stays for the next task that names the slab.
                slab = self.attach(spec)
            slab.populate_slot(ref.slot)  # once per slot per worker: no fault per page later
            view = self.views[key] = SlotView.of(slab.slot_buffer(ref.slot))
        return view

    def send(self, msg: P.ToMain) -> None:
        if self.rng is not None and not isinstance(msg, P.NeedSlot | P.ReplicaState):
            # an answer: see ready()
            self.rng.publish(self.cfg.worker_id, msg.epoch, msg.seq)
        self._write(framed(P.encode(msg)))

    def _write(self, data: bytes) -> None:
        """Write ``data`` whole (a write a signal cuts short is finished). When the main process
        has closed its end (it exited, or was killed), there is no one left to answer: exit
        quietly, as on EOF."""
        try:
            n = os.write(self.fd, data)
            while n < len(data):
                n += os.write(self.fd, memoryview(data)[n:])
        except BrokenPipeError:
            raise SystemExit(0) from None

    def ready(self, task: P.Task, desc: Descriptor) -> None:
        if self.rng is not None:  # the RNG state after this task, published before its answer
            self.rng.publish(self.cfg.worker_id, task.epoch, task.seq)
        nbytes = used_bytes(desc)
        self._write(framed(P.ready(task.seq, task.epoch, self.cfg.worker_id, desc, nbytes)))

    def run(self) -> None:
        while True:
            msg = self.inbox.popleft() if self.inbox else self.read()
            if isinstance(msg, P.Stop):
                return
            if isinstance(msg, P.Task):
                if msg.epoch < self.latest_epoch:
                    self.run_stale_task(msg)  # answered even past the replica's end: DROPPED
                elif self.iteration_end:
                    continue  # torch's workers skip tasks once their replica is exhausted
                else:
                    self.run_task(msg)
                    if HANDED or self.kept.suspects:  # shmloader.empty() memory kept?
                        self.kept.look()
            elif isinstance(msg, P.Resume):
                self.iteration_end = False
                if isinstance(self.dataset, IterDataPipe) and msg.shared_seed is not None:
                    self._apply_shared_seed(msg.shared_seed)
                if self.init_error is None:
                    self.make_fetcher()
            # ATTACH, DETACH, GRANT, DENY and REVOKE were applied when read.

    def run_stale_task(self, task: P.Task) -> None:
        """A task of an abandoned epoch: fetched and collated all the same, because torch's
        workers fetch every task sent to them (the dataset's and collate's random draws must stay
        in step with torch's), then dropped without touching its slot. Past the end of an
        exhausted replica it is not fetched (torch skips it) but still answered, so the main
        process frees the slot it was sent with."""
        if self.iteration_end:
            self.send(P.Dropped(task.seq, task.epoch, self.cfg.worker_id))
            return
        try:
            with SlotSession(None):
                self.fetcher.fetch(task.index)
        except StopIteration:
            if self.cfg.dataset_kind == ITERABLE_KIND:
                self.iteration_end = True
        # User code failed on a batch nobody will see: torch drops it too.
        except Exception:  # noqa: BLE001
            pass
        finally:
            self.collator.samples = None
        self.send(P.Dropped(task.seq, task.epoch, self.cfg.worker_id))

    def run_task(self, task: P.Task) -> None:
        wid = self.cfg.worker_id
        if self.init_error is not None:
            # worker_init_fn (or making the fetcher) failed: every task of this worker fails with
            # that error (torch raises it once, then an unrelated UnboundLocalError).
            self.send(P.Failed(task.seq, task.epoch, wid, self.init_error))
            return
        ref = task.ref
        if self.revoked and (task.epoch, task.seq) in self.revoked:
            self.revoked.discard((task.epoch, task.seq))
            ref = None
        ref = ref or self.take_grant(task.epoch, task.seq)
        try:
            slot = self.slot(ref)
            with SlotSession(slot) as session:
                data = self.fetcher.fetch(task.index)
                packed = Packed(session, data)
                del data
            if self.kept.pending:  # (here: as errors, warnings fail this batch, not the worker)
                self.kept.warn()
            self.replica_state(task)
        except StopIteration:
            if self.cfg.dataset_kind != ITERABLE_KIND:
                self.send(P.Failed(task.seq, task.epoch, wid, wrap_current_exception(self.where())))
                return
            self.iteration_end = True
            self.send(P.Exhausted(task.seq, task.epoch, wid))
            return
        # User code failed: forward it to the main process, as torch does.
        except Exception:  # noqa: BLE001
            failed = wrap_current_exception(self.where())
            self.replica_state(task)  # that batch is consumed when its error is raised
            self.send(P.Failed(task.seq, task.epoch, wid, failed))
            return
        try:
            overflowed = not packed.fits and not packed.session.planned
            if ref is not None and slot is not None and overflowed and packed.needed <= slot.size:
                packed.detach()  # a scratch buffer overflowed, yet the batch fits its slot
                self.ready(task, packed.write_into(ref, slot))
                return
            while ref is None or not packed.fits:
                # No slot yet, or too small: ask, then lay the batch out in the slot granted.
                # Leaves already in the old slot are copied out first, so the main process can
                # free that slot at once: at the arena's cap it may be the room this batch needs.
                packed.detach()
                self.send(P.NeedSlot(task.seq, task.epoch, wid, packed.needed, ref))
                granted = self.wait_grant(task.epoch, task.seq)
                if granted is None:
                    return  # denied (can never fit the arena), epoch abandoned, or teardown
                slot = self.slot(granted)
                assert slot is not None
                if packed.session.planned:  # collate the same samples again, into the slot
                    with SlotSession(slot) as session:
                        packed = Packed(session, self.collator(self.collator.samples))
                elif slot.size >= packed.needed:
                    self.ready(task, packed.write_into(granted, slot))
                    return
                ref = granted
            self.ready(task, packed.describe(ref))
        # User code failed: forward it to the main process, as torch does.
        except Exception:  # noqa: BLE001
            self.send(P.Failed(task.seq, task.epoch, wid, wrap_current_exception(self.where())))
        finally:
            self.collator.samples = None

    def replica_state(self, task: P.Task) -> None:
        """A stateful replica's ``state_dict()`` after ``task``, sent before its answer. One that
        cannot be taken or pickled fails only ``DataLoader.state_dict()``, with the reason."""
        if not self.stateful:
            return
        try:
            state = pickle.dumps(self.dataset.state_dict(), pickle.HIGHEST_PROTOCOL)
        except Exception as e:  # noqa: BLE001
            state = P.UNSAVABLE + f"{type(e).__name__}: {e}".encode()
        # A replica that ran out inside this batch (torch's fetcher then raises StopIteration at
        # the next fetch) may have rewound itself as its pass ended: its state alone would
        # resume a whole pass again (review 31).
        ended = bool(getattr(self.fetcher, "ended", False))
        self.send(P.ReplicaState(task.seq, task.epoch, self.cfg.worker_id, state, ended))

    def wait_grant(self, epoch: int, seq: int) -> SlotRef | None:
        """Block until the slot for task ``seq`` is granted. None if a DENY (answered DROPPED,
        after the RNG snapshot: the main process fails the task), a RESUME (the task's epoch was
        abandoned) or STOP comes first; those and any tasks read meanwhile are queued for
        :meth:`run`."""
        while (epoch, seq) not in self.grants:
            if (epoch, seq) in self.denied:
                self.denied.discard((epoch, seq))
                self.send(P.Dropped(seq, epoch, self.cfg.worker_id))
                return None
            if any(isinstance(m, P.Stop | P.Resume) for m in self.inbox):
                return None
            msg = self.read()
            if not isinstance(msg, P.Attach | P.Detach | P.Grant | P.Deny | P.Revoke):
                self.inbox.append(msg)
        return self.grants.pop((epoch, seq))

    def close(self) -> None:
        if self.rng is not None:
            self.rng.close()
        for slab in self.slabs.values():
            slab.close()
        self.slabs.clear()


def worker_main(cfg: WorkerConfig, conn: Connection) -> None:
    """Entry point of a worker process."""
    for fd in cfg.close_fds:
        with contextlib.suppress(OSError):
            os.close(fd)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})  # blocked since the fork
    # Objects inherited from the main process move to the collector's permanent generation, so
    # the worker's full collections never write to them: their pages stay shared with the main
    # process instead of being copied into this worker (review 8: 12 -> 46 MiB private per
    # worker after one full collection on a dict dataset).
    gc.freeze()
    threading.Thread(
        target=_exit_when_main_exits, args=(cfg.main_pid,), name="shmloader-watchdog", daemon=True
    ).start()
    torch.set_num_threads(1)
    worker = _Worker(cfg, conn)
    try:
        worker.start()
        worker.run()
    finally:
        set_worker_info(None)
        worker.close()
        conn.close()
