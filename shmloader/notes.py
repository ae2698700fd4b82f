"""An explanation added to an exception that keeps torch's type, words and attributes.

Where shmloader raises what torch raises, the message stays torch's and anything shmloader can
add (where the fault came from, what to change) goes in a note, which tracebacks print after the
message (``BaseException.add_note``, Python 3.11+). On Python 3.10, which has no ``add_note``,
the note is kept in ``__notes__`` as 3.11 keeps it, and printed by nothing.
"""

from __future__ import annotations


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
