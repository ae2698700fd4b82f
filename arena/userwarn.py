"""Warnings that point at the user's line, not at ours.

``warnings.warn(..., stacklevel=N)`` needs the caller to know how deep it is, and the depth of a
library's warning differs by path (a ``for`` loop's ``__next__``, a finalizer, a fork hook).
:func:`warn` walks the stack instead: the warning is attributed to the first frame whose file is
outside every *internal* directory. This package's own directory is internal; a library built on
the arena adds its own (and those of the frameworks it runs inside) with :func:`internal`.

Invariant: a warning is never attributed to a frame of an internal directory unless every frame
on the stack is internal (a daemon thread of ours, say); then it names the outermost one, so
``warnings``' once-per-location filters still work.
"""

from __future__ import annotations

import os
import sys
import warnings
import weakref

# This package, and the standard library's finalizer machinery that runs our close-downs.
_internal: tuple[str, ...] = (
    os.path.dirname(os.path.abspath(__file__)) + os.sep,
    os.path.abspath(weakref.__file__),
)


def internal(directory: str) -> None:
    """Count the files under ``directory`` as the library's own: warnings skip their frames."""
    global _internal
    prefix = os.path.abspath(directory) + os.sep
    if prefix not in _internal:
        _internal = (*_internal, prefix)


def warn(message: str, category: type[Warning]) -> None:
    """``warnings.warn(message, category)`` attributed to the innermost frame outside the
    internal directories (see the module docstring)."""
    frame = sys._getframe(1)
    level = 2  # stacklevel 2 names our caller's frame
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_internal):
        frame = frame.f_back
        level += 1
    warnings.warn(message, category, stacklevel=level)
