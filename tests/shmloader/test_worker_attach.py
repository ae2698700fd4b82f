"""A worker on its own, driven through its pipe: a slab it cannot map fails only the task that
names it; when the main process goes, it neither runs queued tasks nor prints a traceback."""

from __future__ import annotations

import multiprocessing
import os
import socket

import pytest
import torch

from arena import Slab, SlotRef
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
