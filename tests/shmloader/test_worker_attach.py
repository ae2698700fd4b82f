"""A worker on its own, driven through its pipe: a slab it cannot map fails only the task that
names it, and the next task that names it maps it again; when the main process goes, it neither
runs queued tasks nor prints a traceback."""

from __future__ import annotations

import errno
import multiprocessing
import os
import socket
from multiprocessing.connection import Connection

import pytest
import torch

import arena.segment
from arena import ArenaDescriptorError, Slab, SlotRef
from shmloader import protocol as P
from shmloader.frames import FrameReader, framed
from shmloader.worker import WorkerConfig, _Worker

from .fakes import Squares


def _worker(end: object, dataset: torch.utils.data.Dataset) -> _Worker:  # type: ignore[type-arg]
    cfg = WorkerConfig(
        worker_id=0,
        num_workers=1,
        dataset_kind=0,
        dataset=dataset,
        auto_collation=True,
        collate_fn=torch.utils.data.default_collate,
        drop_last=False,
        base_seed=0,
        init_fn=None,
        main_pid=os.getpid(),
    )
    worker = _Worker(cfg, end)  # type: ignore[arg-type]
    worker.make_fetcher()
    return worker


def test_a_slab_given_back_before_its_attach_fails_only_the_task_that_names_it():
    gone = Slab.create(7, 4096, 2, "auto")
    spec = gone.spec
    gone.close()  # the owner's descriptor is closed: /proc/<pid>/fd/<fd> no longer opens it
    main, end = multiprocessing.Pipe(duplex=True)
    worker = _worker(end, Squares(8))
    ref = SlotRef(7, 0, 1)
    for msg in (P.Attach(spec), P.Task(0, 0, ref, [0, 1]), P.Detach(7), P.Stop()):
        os.write(main.fileno(), framed(P.encode(msg)))
    worker.run()  # returns at STOP: the failed ATTACH did not end the worker
    answers = FrameReader(main.fileno())
    answer = P.decode(answers.next())
    assert isinstance(answer, P.Failed) and answer.seq == 0
    assert "attach" in str(answer.error.exc_msg), answer.error.exc_msg
    worker.close()
    main.close()
    end.close()


class Counted(Squares):
    """Squares that count the samples fetched."""

    def __init__(self, n: int) -> None:
        super().__init__(n)
        self.fetched: list[int] = []

    def __getitem__(self, i: int) -> torch.Tensor:
        self.fetched.append(i)
        return super().__getitem__(i)


def test_a_worker_waiting_for_a_slot_drops_its_queued_tasks_when_the_main_process_goes():
    # EOF while waiting for a grant: nobody will read answers, so the tasks queued behind are
    # not run (review 8c: they were, and their answers met a closed pipe: BrokenPipeError).
    main, end = multiprocessing.Pipe(duplex=True)
    data = Counted(8)
    worker = _worker(end, data)
    for msg in (P.Task(0, 0, None, [0, 1]), P.Task(1, 0, None, [2, 3])):
        os.write(main.fileno(), framed(P.encode(msg)))
    with socket.socket(fileno=os.dup(main.fileno())) as s:
        s.shutdown(socket.SHUT_WR)  # the worker reads EOF; its own writes still go through
    worker.run()  # returns at EOF
    answers = FrameReader(main.fileno())
    first = P.decode(answers.next())
    assert isinstance(first, P.NeedSlot) and first.seq == 0
    assert not answers.ready(), "the worker ran a task queued behind the one that waited"
    assert data.fetched == [0, 1]
    worker.close()
    main.close()
    end.close()


def test_a_worker_exits_quietly_when_its_answer_meets_a_closed_pipe():
    main, end = multiprocessing.Pipe(duplex=True)
    worker = _worker(end, Squares(8))
    os.write(main.fileno(), framed(P.encode(P.Task(0, 0, None, [0, 1]))))
    main.close()
    with pytest.raises(SystemExit) as exited:
        worker.run()
    assert exited.value.code == 0
    worker.close()
    end.close()


def _answers(main: Connection, n: int) -> list[P.ToMain]:
    reader = FrameReader(main.fileno())
    out = [P.decode(reader.next()) for _ in range(n)]
    assert not reader.ready(), "the worker sent more answers than tasks"
    return out  # type: ignore[return-value]


def test_a_slab_the_worker_could_not_map_is_mapped_by_the_next_task_that_names_it(monkeypatch):
    # Review 10b (t6): a worker briefly out of descriptors when a slab's ATTACH came kept that
    # failure for good: every later task naming the slab failed, long after descriptors were
    # back. Now the task that names the slab tries again; only tasks that still cannot map fail.
    slab = Slab.create(7, 4096, 2, "memfd")
    real = arena.segment.reopen_descriptor
    outcomes = iter([False, False])  # the ATTACH and task 0's retry find no descriptor

    def short_of_descriptors(owner_pid: int, fd: int, flags: int) -> int:
        if next(outcomes, True):
            return real(owner_pid, fd, flags)
        raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))

    monkeypatch.setattr(arena.segment, "reopen_descriptor", short_of_descriptors)
    main, end = multiprocessing.Pipe(duplex=True)
    worker = _worker(end, Squares(8))
    tasks = [P.Task(0, 0, SlotRef(7, 0, 1), [0, 1]), P.Task(1, 0, SlotRef(7, 1, 1), [2, 3])]
    for msg in (P.Attach(slab.spec), *tasks, P.Task(2, 0, SlotRef(7, 0, 2), [4, 5]), P.Stop()):
        os.write(main.fileno(), framed(P.encode(msg)))
    worker.run()
    failed, *ready = _answers(main, 3)
    assert isinstance(failed, P.Failed) and failed.seq == 0
    assert [type(a) for a in ready] == [P.Ready, P.Ready]
    assert [a.seq for a in ready] == [1, 2]  # type: ignore[union-attr]
    # The batches are in the slab, as written by the worker.
    x = torch.frombuffer(slab.slot_buffer(1), dtype=torch.float32, count=24)
    assert x.view(2, 3, 4)[1].eq(3.0).all()
    # What the main process re-raises: the arena's type, with the numbers and the fix.
    with pytest.raises(ArenaDescriptorError) as raised:
        failed.error.reraise()
    text = str(raised.value)
    assert "Caught ArenaDescriptorError in DataLoader worker process 0" in text
    assert "Too many open files" in text and "`ulimit -n` = " in text
    assert "worker_init_fn" in text
    assert "owner may have exited" not in text
    worker.close()
    slab.close()
    main.close()
    end.close()


def test_a_task_naming_a_slab_given_back_fails_alone_with_the_reason():
    gone = Slab.create(7, 4096, 2, "memfd")
    spec = gone.spec
    gone.close()
    keep = Slab.create(8, 4096, 2, "memfd")
    main, end = multiprocessing.Pipe(duplex=True)
    worker = _worker(end, Squares(8))
    frames = (
        P.Attach(spec),
        P.Attach(keep.spec),
        P.Task(0, 0, SlotRef(7, 0, 1), [0, 1]),
        P.Task(1, 0, SlotRef(8, 0, 1), [2, 3]),
        P.Detach(7),
        P.Stop(),
    )
    for msg in frames:
        os.write(main.fileno(), framed(P.encode(msg)))
    worker.run()
    failed, ready = _answers(main, 2)
    assert isinstance(failed, P.Failed) and failed.seq == 0
    assert "cannot attach shared-memory segment" in failed.error.exc_msg
    assert isinstance(ready, P.Ready) and ready.seq == 1
    assert 7 not in worker.unattached and 7 not in worker.slabs  # DETACH forgot it
    worker.close()
    keep.close()
    main.close()
    end.close()
