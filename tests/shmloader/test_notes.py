"""shmloader.notes: a note on an exception, on Python 3.11+ (add_note) and 3.10 (no add_note)."""

from __future__ import annotations

import traceback
from typing import Any

from shmloader.notes import add_note


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
