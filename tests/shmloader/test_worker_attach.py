"""A worker that cannot map a slab it is told about (the arena gave the slab back before the
worker read its ATTACH) stays alive: only a task that names that slab fails, with the reason."""

from __future__ import annotations

import multiprocessing
import os

import torch

from arena import Slab, SlotRef
from shmloader import protocol as P
from shmloader.frames import FrameReader, framed
from shmloader.worker import WorkerConfig, _Worker

from .fakes import Squares


def test_a_slab_given_back_before_its_attach_fails_only_the_task_that_names_it():
    gone = Slab.create(7, 4096, 2, "auto")
    spec = gone.spec
    gone.close()  # the owner's descriptor is closed: /proc/<pid>/fd/<fd> no longer opens it
    main, end = multiprocessing.Pipe(duplex=True)
    cfg = WorkerConfig(
        worker_id=0,
        num_workers=1,
        dataset_kind=0,
        dataset=Squares(8),
        auto_collation=True,
        collate_fn=torch.utils.data.default_collate,
        drop_last=False,
        base_seed=0,
        init_fn=None,
        main_pid=os.getpid(),
    )
    worker = _Worker(cfg, end)
    worker.make_fetcher()
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
