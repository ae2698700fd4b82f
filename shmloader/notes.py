"""An explanation added to an exception that keeps torch's type, words and attributes.

Where shmloader raises what torch raises, the message stays torch's and anything shmloader can
add (where the fault came from, what to change) goes in a note, which tracebacks print after the
message (``BaseException.add_note``, Python 3.11+). On Python 3.10, which has no ``add_note``,
the note is kept in ``__notes__`` as 3.11 keeps it, and printed by nothing.
"""

from __future__ import annotations

import traceback


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


def frameless(error: BaseException, where: str) -> BaseException:
    """``error``, to be kept and raised later, holding no frame: the tracebacks of it and of the
    exceptions it chains to are cleared (each kept frame leads, through ``f_back``, to the
    frame that caught it, which holds the object keeping the error: a cycle that kept a dropped
    iterator, its workers and its slots alive until a garbage collection; reviews 75 and 76),
    and what they said goes in a note after ``where`` (why it is raised later)."""
    told = "".join(traceback.format_exception(error)).rstrip()
    chain: list[BaseException | None] = [error]
    seen: set[int] = set()
    while chain:
        e = chain.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        e.__traceback__ = None
        chain += [e.__cause__, e.__context__]
    add_note(error, f"({where}; where it was raised:)\n{told}")
    return error
