"""The batch of rows ``ArrowDataset.__getitems__`` returns: a list that gathers only when read.

``ArrowRows`` is a :class:`shmloader.collate.GatheredRows`. shmloader's default collate calls
:meth:`ArrowRows.collate_into`, which gathers each column straight into the batch's slot. Any
other reader (torch's ``default_collate``, a custom ``collate_fn``) gets the list of row dicts:
the first access through a list method fills the list (one gather into private memory, then
per-row items), and from then on it is an ordinary list.

Invariants:
- Until filled, the underlying list storage is empty and ``len()`` is the number of rows
  requested; every list method (read or write) fills it first, then runs ``list``'s own code.
- Once filled, :meth:`collate_into` declines (``NotImplemented``): the rows may have been
  changed, so they are collated one by one like any list.
- Pickling gives a plain list of the rows.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from shmloader.arrow.columns import Where
from shmloader.collate import Alloc, GatheredRows

if TYPE_CHECKING:
    from shmloader.arrow.dataset import ArrowDataset


class ArrowRows(GatheredRows):
    """Rows ``where`` of ``dataset``, gathered column by column when first needed."""

    def __init__(self, dataset: ArrowDataset, where: Where) -> None:
        super().__init__()
        self._dataset = dataset
        self._where = where
        self._filled = False

    def _fill(self) -> None:
        if not self._filled:
            self._filled = True
            list.extend(self, self._dataset._rows(self._where))

    def collate_into(self, alloc: Alloc) -> Any:
        if self._filled:
            return NotImplemented
        return self._dataset._collate(self._where, alloc, "stack")

    def __len__(self) -> int:
        return list.__len__(self) if self._filled else len(self._where)

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, ...]:
        self._fill()
        return (list, (list(self),))


# Every list method but __len__ and __init__: fill first, then do what list does.
_FILL_FIRST = (
    "__getitem__", "__setitem__", "__delitem__", "__iter__", "__reversed__", "__contains__",
    "__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__", "__repr__", "__add__", "__mul__",
    "__rmul__", "__iadd__", "__imul__", "append", "extend", "insert", "pop", "remove", "clear",
    "index", "count", "copy", "sort", "reverse",
)


def _filling(name: str) -> Callable[..., Any]:
    method = getattr(list, name)

    def call(self: ArrowRows, *args: Any, **kwargs: Any) -> Any:
        self._fill()
        return method(self, *args, **kwargs)

    call.__name__ = name
    call.__doc__ = method.__doc__
    return call


for _name in _FILL_FIRST:
    setattr(ArrowRows, _name, _filling(_name))
