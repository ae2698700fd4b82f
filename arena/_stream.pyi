from collections.abc import Sequence

STREAMING: int

def gather(dst: int, size: int, srcs: Sequence[int], /) -> None: ...
