"""shmloader.notes: a note on an exception, on Python 3.11+ (add_note) and 3.10 (no add_note)."""

from __future__ import annotations

import dataclasses
import gc
import sys
import traceback
import weakref
from collections.abc import Callable
from typing import Any

from shmloader.notes import add_note, frameless, raise_kept, reraise, traceless


def test_a_note_is_printed_after_the_message_and_leaves_the_message_alone():
    error = RuntimeError("torch's words")
    add_note(error, "what shmloader adds")
    assert str(error) == "torch's words"
    assert "what shmloader adds" in "".join(traceback.format_exception(error))


class _NoAddNote:
    """Stands for an exception on Python 3.10, which has no ``add_note``."""

    __notes__: Any = None


def test_without_add_note_the_notes_are_kept_where_311_keeps_them():
    error = _NoAddNote()
    add_note(error, "first")  # type: ignore[arg-type]
    add_note(error, "second")  # type: ignore[arg-type]
    assert error.__notes__ == ["first", "second"]


class _Refusing(Exception):
    def with_traceback(self, tb):  # type: ignore[no-untyped-def]
        raise TypeError("with_traceback refused")


def test_frameless_never_raises_for_an_exception_that_refuses_its_steps():
    """Review 78: an exception class whose with_traceback() raises made a resumed iter() raise
    that TypeError in place of keeping the sampler's error for its turn."""
    try:
        raise _Refusing("kept")
    except _Refusing as e:
        error = e
    assert frameless(error, "kept for later") is error
    assert str(error) == "kept"


def test_frameless_keeps_no_frame_and_cuts_the_link_to_the_exception_being_handled():
    """Review 75, 77, 78: the error and what it chains to lose their frames, but for the
    exception the caller handles (the user's), which keeps its own and is no longer linked."""
    try:
        raise LookupError("the user's")
    except LookupError as handled:
        try:
            try:
                raise KeyError("inner")
            except KeyError as inner:
                raise ValueError("outer") from inner
        except ValueError as e:
            error = e
        kept = frameless(error, "kept for later", handled)
        assert handled.__traceback__ is not None
    assert kept.__traceback__ is None
    assert isinstance(kept.__cause__, KeyError) and kept.__cause__.__traceback__ is None
    assert kept.__cause__.__context__ is None  # (it was the user's exception)
    assert "raise ValueError" in "".join(kept.__notes__)


class _OddGroup(ExceptionGroup):  # type: ignore[type-arg]  # noqa: F821  (Python 3.11+)
    @property
    def exceptions(self):  # type: ignore[no-untyped-def, override]
        raise RuntimeError("exceptions refused")


def test_frameless_walks_an_exception_groups_own_members_and_never_raises():
    """Review 80: a group subclass whose ``exceptions`` raised made frameless raise (and with
    it every resumed iter()); the base class's members are walked."""
    try:
        raise KeyError("member")
    except KeyError as e:
        member = e
    group = _OddGroup("group", [member])
    assert member.__traceback__ is not None
    assert frameless(group, "kept for later") is group
    assert member.__traceback__ is None


class _Hard(Exception):
    pass


def test_raise_kept_raises_a_copy_with_the_words_notes_and_chain_and_keeps_none_of_its_frames():
    """Review 81: an error kept to raise at every use, raised itself, took each raise's traceback
    (and with it the caller's frames) for as long as it was kept."""
    try:
        try:
            raise KeyError("the cause")
        except KeyError as cause:
            raise _Hard("kept error") from cause
    except _Hard as e:
        kept = traceless(e)
    add_note(kept, "a note")
    raised = []
    for _ in range(2):
        try:
            raise_kept(kept)
        except _Hard as e:
            e.add_note("the user's own note")
            raised.append(e)
    first, second = raised
    assert first is not kept and second is not first
    assert kept.__traceback__ is None and kept.__notes__ == ["a note"]
    assert str(first) == "kept error" and first.__notes__ == ["a note", "the user's own note"]
    assert isinstance(first.__cause__, KeyError) and first.__suppress_context__
    assert "The above exception was the direct cause" in "".join(traceback.format_exception(first))


def test_reraise_raises_what_the_wrapper_raises_and_clears_its_frame():
    """Review 81: torch's ExceptionWrapper.reraise keeps what it raises in a local of its frame,
    which the traceback holds: a cycle."""
    from torch._utils import ExceptionWrapper

    try:
        raise ValueError("in a worker")
    except ValueError:
        wrapper = ExceptionWrapper(where="in DataLoader worker process 0")
    try:
        reraise(wrapper)
    except ValueError as e:
        error = e
    assert str(error).startswith("Caught ValueError in DataLoader worker process 0.")
    tb = error.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_name != "reraise":
        tb = tb.tb_next
    assert tb is not None  # (this module's frame, then notes.reraise's)
    frames = []
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    assert all(error not in frame.f_locals.values() for frame in frames)


@dataclasses.dataclass(frozen=True)
class _Frozen(Exception):
    what: str


class _Rewords(Exception):
    def __init__(self, name: str) -> None:
        super().__init__(f"{name}: changed since it was opened")


def test_raise_kept_keeps_no_frame_of_a_frozen_error_and_the_words_of_one_that_rewords():
    """Review 82: the copy's chain was set through the class's own ``__setattr__``, which a
    frozen dataclass refuses (the kept error itself was raised, taking the caller's frames);
    and ``copy.copy`` rebuilds an error from its arguments, which a constructor that rewords
    them words twice (that one is raised itself, its words kept)."""
    frozen = traceless(_Frozen("kept"))
    try:
        raise_kept(frozen)
    except _Frozen as e:
        assert e is not frozen and e.what == "kept"
    assert frozen.__traceback__ is None
    rewords = traceless(_Rewords("t.arrow"))
    try:
        raise_kept(rewords)
    except _Rewords as e:
        assert str(e) == "t.arrow: changed since it was opened"
        assert e is not rewords  # (review 83: it was raised itself, keeping the caller)
    assert rewords.__traceback__ is None


class _Unprintable(Exception):
    def __str__(self) -> str:
        raise RuntimeError("no words")


class _Holder:
    def use(self, kept: BaseException) -> None:
        raise_kept(kept)


def test_an_error_raise_kept_cannot_copy_holds_only_the_last_caller_it_failed():
    """Review 83: one that no way copies (its words cannot be compared) is raised itself; each
    raise clears the traceback the last one gave it, so it holds one caller's frames at most."""
    kept = traceless(_Unprintable("kept"))
    first, second = _Holder(), _Holder()
    gone = weakref.ref(first)
    gc.collect()
    gc.disable()
    try:
        for holder in (first, second):
            try:
                holder.use(kept)
            except _Unprintable as e:
                assert e is kept
        del holder, first
        assert gone() is None
    finally:
        gc.enable()


def _lines_run(code: Any, run: Callable[[], None]) -> list[int]:
    lines: list[int] = []

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        if frame.f_code is not code:
            return None

        def local(frame: Any, event: str, arg: Any) -> Any:
            if event == "line":
                lines.append(frame.f_lineno)
            return local

        return local

    previous = sys.gettrace()  # (a debugger's or coverage's: put back after)
    sys.settrace(tracer)
    try:
        run()
    except BaseException:  # noqa: BLE001
        pass
    finally:
        sys.settrace(previous)
    return sorted(set(lines))


def _interrupt_at(code: Any, line: int, previous: Any) -> Callable[..., Any]:
    """A trace function raising KeyboardInterrupt when ``code`` reaches ``line``."""

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        if frame.f_code is not code:
            return None

        def local(frame: Any, event: str, arg: Any) -> Any:
            if event == "line" and frame.f_lineno == line:
                sys.settrace(previous)
                raise KeyboardInterrupt
            return local

        return local

    return tracer


def _interrupted_at_every_line(codes: list[Any], call: Callable[[Any], None]) -> list[str]:
    """Call ``call(holder)`` once for each line the ``codes`` run, a KeyboardInterrupt raised at
    that line; the lines after which ``holder`` outlived its last reference (gc off)."""
    left = []
    for code in codes:
        for line in _lines_run(code, lambda: call(None)):
            previous = sys.gettrace()
            holder = _Holder()
            gone = weakref.ref(holder)
            gc.collect()
            gc.disable()
            try:
                sys.settrace(_interrupt_at(code, line, previous))
                try:
                    call(holder)
                except BaseException:  # noqa: BLE001  (the interrupt, or what is raised)
                    pass
                finally:
                    sys.settrace(previous)
                del holder
                if gone() is not None:
                    left.append(f"{code.co_name} line {line}")
            finally:
                gc.enable()
    return left


def test_a_ctrl_c_anywhere_in_reraises_own_code_leaves_no_cycle():
    """Review 83: a local of notes.reraise holding a traceback entry after its own led back to
    its frame (that entry's ``f_back``): a KeyboardInterrupt raised while it was set left a cycle
    holding the caller until a garbage collection. Raised at each line of reraise and of its
    helper in turn, none does. (A wrapper with no cycle of its own, MainError: torch's
    ExceptionWrapper has one from its raise until reraise clears its frame, a window no code
    after that raise can close; review 84.)"""
    from shmloader import notes
    from shmloader.dispatch import MainError

    def call(holder: Any) -> None:
        reraise(MainError(ValueError("a worker's")))

    codes = [notes.reraise.__code__, notes._clear_frame_after.__code__]
    assert _interrupted_at_every_line(codes, call) == []


def test_a_ctrl_c_anywhere_in_raise_kept_leaves_no_cycle():
    """Review 84: raise_kept's frame held the copy it raised in a local until its finally ran:
    a KeyboardInterrupt there left the copy's traceback holding that frame, and so the caller,
    until a garbage collection."""
    from shmloader import notes

    kept = traceless(FileNotFoundError(2, "No such file or directory", "t.arrow"))

    def call(holder: Any) -> None:
        raise_kept(kept)

    codes = [notes.raise_kept.__code__, notes._fresh.__code__, notes._copy.__code__]
    assert _interrupted_at_every_line(codes, call) == []


def test_raise_kept_copies_the_chain_and_the_fields():
    """Review 84: the copy shared its cause and context with the kept error, so a caller that
    raised the cause (or noted on it) left its traceback, and so its frames, and its note in
    the kept one for every later caller; and fields set outside the arguments (OSError's
    ``filename2``, AttributeError's ``name``) were lost in the copy."""
    try:
        try:
            raise OSError(24, "Too many open files", "a.arrow")
        except OSError as cause:
            raise OSError(24, "opening shard 1 of 9: out of descriptors") from cause
    except OSError as e:
        kept = traceless(e)
    for _ in range(2):
        try:
            try:
                raise_kept(kept)
            except OSError as e:
                e.__cause__.add_note("seen by this caller")  # type: ignore[union-attr]
                raise e.__cause__  # type: ignore[misc]  # noqa: B904  (as a user may)
        except OSError as e:
            assert e.__notes__ == ["seen by this caller"] and e.filename == "a.arrow"
    assert kept.__cause__ is not None and kept.__cause__.__traceback__ is None
    assert not hasattr(kept.__cause__, "__notes__")
    both = OSError(2, "No such file or directory")
    both.filename2 = "b.arrow"
    missing = AttributeError("no field")
    missing.name, missing.obj = "field", 42
    for error, field, value in ((both, "filename2", "b.arrow"), (missing, "name", "field")):
        try:
            raise_kept(traceless(error))
        except type(error) as e:
            assert getattr(e, field) == value and e is not error


def test_an_error_raise_kept_cannot_copy_takes_no_context_of_a_caller_before():
    """Review 84: raised itself while a caller handled another exception, the kept error kept
    that one as its context: a later caller, handling nothing, saw it, and it held the first
    caller's frames."""
    kept = traceless(_Unprintable("kept"))
    try:
        try:
            raise KeyError("the first caller's own")
        except KeyError:
            raise_kept(kept)
    except _Unprintable:
        pass
    try:
        raise_kept(kept)
    except _Unprintable as e:
        assert e.__context__ is None


def _users_own_code() -> None:
    users_local = "theirs to inspect"  # noqa: F841
    raise ValueError("raised by the user's code")


class _Wrapper:
    def reraise(self) -> None:
        _users_own_code()


def test_reraise_clears_only_the_wrappers_own_frame():
    """Review 82: every frame after notes.reraise's was cleared, the user's own too (an
    exception class's constructor on torch's ``message=`` path): their locals were gone for
    ``--showlocals`` and post-mortem debugging."""
    try:
        reraise(_Wrapper())
    except ValueError as e:
        tb = e.__traceback__
        names = {}
        while tb is not None:
            names[tb.tb_frame.f_code.co_name] = tb.tb_frame.f_locals
            tb = tb.tb_next
    assert names["_users_own_code"] == {"users_local": "theirs to inspect"}
    assert names["reraise"] == {}  # (the wrapper's: the last frame of that name)
