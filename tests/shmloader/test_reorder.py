from arena import SlotRef
from shmloader.reorder import TaskTable


def test_answers_are_released_in_sequence_order():
    t: TaskTable[str] = TaskTable()
    for w in (0, 1, 0):
        t.add(w, None)
    t.get(2).answer = "c"
    t.get(1).answer = "b"
    assert t.next_in_order(lambda w: True).seq == 0  # seq 0 still pending: waits for it
    t.get(0).answer = "a"
    got = []
    while (info := t.next_in_order(lambda w: True)) is not None and info.answer is not None:
        got.append(t.take_next().answer)
    assert got == ["a", "b", "c"]
    assert len(t) == 0


def test_unanswered_tasks_of_a_retired_worker_are_skipped_and_reported():
    t: TaskTable[str] = TaskTable()
    a = t.add(0, SlotRef(0, 0, 1))
    t.add(1, SlotRef(0, 1, 1))
    c = t.add(0, SlotRef(0, 2, 1))
    c.answer = "c"
    a.answer = "a"
    assert t.next_in_order(lambda w: w == 0) is a
    t.take_next()
    nxt = t.next_in_order(lambda w: w == 0)
    assert nxt is c
    skipped = t.skipped()
    assert [s.seq for s in skipped] == [1] and skipped[0].ref == SlotRef(0, 1, 1)
    assert t.skipped() == []


def test_a_task_popped_out_of_order_is_passed_over_later():
    t: TaskTable[str] = TaskTable()
    t.add(0, None)
    b = t.add(1, None)
    b.answer = "b"
    assert t.pop(1) is b
    first = t.next_in_order(lambda w: True)
    assert first.seq == 0
    first.answer = "a"
    t.take_next()
    assert t.next_in_order(lambda w: True) is None
    assert (t.rcvd, t.sent) == (2, 2)
