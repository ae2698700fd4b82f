"""An explanation added to an exception that keeps torch's type, words and attributes.

Where shmloader raises what torch raises, the message stays torch's and anything shmloader can
add (where the fault came from, what to change) goes in a note, which tracebacks print after the
message (``BaseException.add_note``, Python 3.11+). On Python 3.10, which has no ``add_note``,
the note is kept in ``__notes__`` as 3.11 keeps it, and printed by nothing.

:func:`frameless` keeps an error to raise later (a sampler's, drawn ahead of its turn) without
the frames its traceback holds; where it was raised goes in a note. :func:`reraise` raises what
torch's ``ExceptionWrapper.reraise()`` raises (a worker's error, a custom ``pin_memory()``'s),
without the reference cycle torch's frame makes.

Invariant: an error shmloader raises to the user, or keeps to raise later, forms no reference
cycle with the frames it passed (nor a chain from what outlives them), so an iterator the user
drops after catching it goes with its last reference, its workers and slots with it, not at some
later garbage collection. (One exception, :mod:`shmloader.prefetch`'s: an error a
``DevicePrefetcher`` still holds queued when it is dropped.)
"""

from __future__ import annotations

import builtins
import contextlib
import copy
import traceback
from types import MemberDescriptorType, TracebackType
from typing import Any, NoReturn

_GROUP: Any = getattr(builtins, "BaseExceptionGroup", None)  # (Python 3.11+)
# BaseException's own descriptors: through them, a class whose __setattr__ refuses (a frozen
# dataclass) still has its context read and cut
_CONTEXT: Any = vars(BaseException)["__context__"]
_CAUSE: Any = vars(BaseException)["__cause__"]
_SUPPRESS: Any = vars(BaseException)["__suppress_context__"]


def add_note(error: BaseException, note: str) -> None:
    """Add ``note`` to ``error`` (module docstring)."""
    adder = getattr(error, "add_note", None)
    if adder is not None:
        adder(note)
        return
    notes = getattr(error, "__notes__", None)
    if not isinstance(notes, list):
        notes = []
        error.__notes__ = notes
    notes.append(note)


def frameless(
    error: BaseException, where: str, handled: BaseException | None = None
) -> BaseException:
    """``error``, to be kept and raised later, holding no frame: each kept frame leads, through
    ``f_back``, to the frame that caught it, which holds the object keeping the error (a cycle
    that kept a dropped iterator, its workers and its slots alive until a garbage collection;
    review 75). The tracebacks of ``error`` and of the exceptions it chains to (``__cause__``,
    ``__context__``, an exception group's members) are cleared, but for ``handled`` and what it
    chains to (the exception the caller was handling: the user's own, whose traceback is
    theirs; review 77), whose link from the chain is cut (raised later, the error takes the
    context of then); what they said goes in a note after ``where``. Never raises: what an
    exception refuses (its note, say, a frozen dataclass) it is kept without."""
    told = None
    with contextlib.suppress(Exception):  # (an exception class may refuse any step: each alone)
        told = "".join(traceback.format_exception(error)).rstrip()
    traceless(error, handled)
    if told is not None:
        note = f"({where}; where it was raised:)\n{told}"
        try:
            add_note(error, note)
        except Exception:  # noqa: BLE001  (a frozen dataclass: past its __setattr__)
            with contextlib.suppress(Exception):
                notes = getattr(error, "__notes__", None)
                object.__setattr__(error, "__notes__", [*(notes or ()), note])
    return error


def traceless(error: BaseException, handled: BaseException | None = None) -> BaseException:
    """``error`` with the tracebacks of it and of the exceptions it chains to cleared
    (:func:`frameless`'s first step, without the note), but for ``handled`` and what it chains
    to, whose link from the chain is cut. Never raises."""
    chain: list[BaseException | None] = [error]
    seen: set[int] = set() if handled is None else {id(handled)}
    while chain:
        e = chain.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        with contextlib.suppress(Exception):
            BaseException.with_traceback(e, None)  # (not e's own: a class may override it)
        with contextlib.suppress(Exception):
            if handled is not None and _CONTEXT.__get__(e) is handled:
                # raised later, it takes the context of then, as the saved run's did (review 78)
                _CONTEXT.__set__(e, None)
        with contextlib.suppress(Exception):
            chain += [_CAUSE.__get__(e), _CONTEXT.__get__(e)]
        with contextlib.suppress(Exception):  # (the group's own members, not a subclass's)
            if _GROUP is not None and issubclass(type(e), _GROUP):
                chain += vars(_GROUP)["exceptions"].__get__(e)
    return error


def raise_kept(error: BaseException) -> NoReturn:
    """Raise ``error``, kept (:func:`traceless`) to be raised at every use, as a copy with its
    words, fields, notes and chain, each link copied too: raised itself, it would keep each
    raise's traceback, whose frames hold the caller (an iterator whose sampler asked a broken
    dataset for its length, its workers and slots with it) for as long as the keeper keeps the
    error (review 81); and a caller that raised a link of its chain, or noted on it, would
    leave that in the kept one (review 84). Each is rebuilt from its arguments
    (``ArrowSourceError`` and ``OSError`` are: through ``copy.copy``, else ``__new__`` and its
    ``__dict__``), with its C-level fields (``filename2``, ``name``...). One that no way copies
    with the same words is raised itself, its last traceback and context cleared first: it holds
    only the last caller it failed (review 83)."""
    raise _fresh(error)  # (no local holds what is raised: no cycle with this frame; review 84)


def _fresh(error: BaseException) -> BaseException:
    fresh = _copy(error, {})
    if fresh is None:
        BaseException.with_traceback(error, None)
        _CONTEXT.__set__(error, None)  # (the last caller's own exception, else)
        return error
    return fresh


def _copy(error: BaseException, made: dict[int, BaseException | None]) -> BaseException | None:
    """A copy of ``error`` with its type, words, fields, notes and chain (links copied as far
    as they copy: ``made`` maps the ``id`` of each link met to its copy), no traceback; or
    None."""
    if id(error) in made:
        return made[id(error)]
    made[id(error)] = None  # (a chain that loops back shares that link)
    for make in (copy.copy, _from_args):
        try:
            fresh = make(error)
            if type(fresh) is not type(error):
                continue  # (a __reduce__ of another class)
            _copy_fields(error, fresh)
            if str(fresh) != str(error):
                continue  # (a constructor that rewords its arguments)
            # through BaseException's own descriptors: a class may refuse them (frozen)
            BaseException.with_traceback(fresh, None)
            made[id(error)] = fresh
            for link in (_CAUSE, _CONTEXT):
                old = link.__get__(error)
                link.__set__(fresh, None if old is None else _copy(old, made) or old)
            _SUPPRESS.__set__(fresh, _SUPPRESS.__get__(error))
            notes = getattr(error, "__notes__", None)
            if isinstance(notes, list):  # (notes added to the copy stay its own)
                object.__setattr__(fresh, "__notes__", list(notes))
            return fresh
        except Exception:  # noqa: BLE001  (a __str__ that raises, a __new__ that wants more)
            made[id(error)] = None
            continue
    return None


def _copy_fields(error: BaseException, fresh: BaseException) -> None:
    """Copy the C-level fields of ``error`` (member descriptors of its classes: ``OSError``'s
    ``filename2``, ``AttributeError``'s ``name`` and ``obj``, ``__slots__``) that rebuilding from
    the arguments leaves out. One not set, or None, is left as the copy has it (set to None,
    ``OSError``'s words would name a second file ``None``)."""
    for cls in type(error).__mro__:
        for name, field in vars(cls).items():
            if isinstance(field, MemberDescriptorType) and name != "__suppress_context__":
                try:
                    value = field.__get__(error)
                except AttributeError:
                    continue  # (a slot never set)
                if value is not None:
                    field.__set__(fresh, value)


def _from_args(error: BaseException) -> BaseException:
    """``error``'s class made from its arguments without its constructor, given its
    ``__dict__`` (what ``copy.copy`` cannot rebuild: a frozen dataclass refuses
    ``__setstate__``'s assignments, a constructor may reword its arguments)."""
    fresh = type(error).__new__(type(error), *error.args)
    vars(fresh).update(vars(error))
    return fresh


def reraise(wrapper: Any) -> NoReturn:
    """Raise what ``wrapper.reraise()`` raises (torch's ``ExceptionWrapper``, or a
    ``MainError``), with the same type, words and traceback, but with the locals of the
    wrapper's ``reraise`` frame cleared: torch's keeps the exception it raises in a local, so the
    exception's traceback held the frame that held the exception, a cycle through which the
    traceback's other frames (the iterator's own ``next()``) kept a dropped iterator, its workers
    and its slots alive until a garbage collection (review 81)."""
    code = getattr(getattr(type(wrapper), "reraise", None), "__code__", None)
    try:
        wrapper.reraise()
    except BaseException as error:
        # (in a function of its own: a local here holding a traceback entry after this frame's
        # would lead back to this frame through that entry's f_back, a cycle if anything
        # raised in between; review 83)
        _clear_frame_after(error.__traceback__, code)
        raise
    raise TypeError(f"{type(wrapper).__name__}.reraise() returned instead of raising")


def _clear_frame_after(tb: TracebackType | None, code: Any) -> None:
    """Clear the locals of the frame after ``tb``'s first entry if it runs ``code``: only the
    wrapper's own ``reraise``, never a frame after it, which is the user's (an exception class's
    constructor), whose locals are theirs to inspect (review 82)."""
    after = None if tb is None else tb.tb_next
    if after is not None and after.tb_frame.f_code is code:
        with contextlib.suppress(RuntimeError):  # (a frame still running cannot be)
            after.tb_frame.clear()
