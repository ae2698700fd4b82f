"""Command-line tools built on shmloader: the side-by-side benchmark (``python -m tools.bench``).

The tools depend on ``shmloader`` and ``arena``; neither package depends on them.
"""
