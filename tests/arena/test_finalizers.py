"""Tests of arena.finalizers: a finalizer an interruption skipped runs later, once; no other."""

from __future__ import annotations

import gc
import weakref
from typing import Any

import pytest

from arena import finalizers


class Thing:
    pass


def test_a_skipped_finalizer_runs_at_the_next_sweep_and_only_once(monkeypatch):
    ran: list[str] = []
    real = weakref.finalize.__call__

    def interrupted(self: weakref.finalize, _: Any = None) -> Any:
        if self._registry.get(self) is not None and self._registry[self].args == ("skipped",):
            raise KeyboardInterrupt  # at its first line, as a Ctrl-C landing there would
        return real(self, _)

    a, b = Thing(), Thing()
    finalizers.on_death(a, ran.append, "skipped")
    finalizers.on_death(b, ran.append, "normal")
    monkeypatch.setattr(weakref.finalize, "__call__", interrupted)
    del a, b  # the garbage collector prints the interruption
    gc.collect()
    monkeypatch.undo()
    assert ran == ["normal"]
    assert finalizers.run_skipped() == 1
    assert ran == ["normal", "skipped"]
    assert finalizers.run_skipped() == 0
    assert ran == ["normal", "skipped"]


def test_a_live_objects_finalizer_is_never_run_by_a_sweep():
    ran: list[int] = []
    kept = Thing()
    done = finalizers.on_death(kept, ran.append, 1)
    assert finalizers.run_skipped() == 0
    assert ran == [] and done.alive
    del kept
    assert ran == [1]


def test_what_a_late_finalizer_raises_is_a_warning(monkeypatch):
    real = weakref.finalize.__call__

    def fails() -> None:
        raise ValueError("boom")

    def interrupted(self: weakref.finalize, _: Any = None) -> Any:
        info = self._registry.get(self)
        if info is not None and info.func is fails:
            raise KeyboardInterrupt
        return real(self, _)

    gone = Thing()
    finalizers.on_death(gone, fails)
    monkeypatch.setattr(weakref.finalize, "__call__", interrupted)
    del gone
    gc.collect()
    monkeypatch.undo()
    with pytest.warns(RuntimeWarning, match="a finalizer run late raised ValueError"):
        assert finalizers.run_skipped() == 1


def test_forgotten_once_run_so_the_list_stays_small():
    for _ in range(1000):
        finalizers.on_death(Thing(), int)  # each object dies at once; its finalizer runs
    assert len(finalizers._made) <= 2 * finalizers._kept_after_prune[0] + 64
    finalizers.run_skipped()
    assert all(f.alive for f in finalizers._made)
