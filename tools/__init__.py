"""Command-line tools built on ``shmloader`` and ``arena`` (``python -m tools.bench`` and others).

Dependencies point one way: the tools import ``shmloader`` and ``arena``; neither imports them.
"""
