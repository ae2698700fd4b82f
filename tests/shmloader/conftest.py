"""Fixtures shared by the shmloader tests."""

import pytest

from arena import Arena


@pytest.fixture
def arena():
    """A private arena (64 MiB cap, 4 slots per slab), closed after the test."""
    a = Arena(max_bytes=1 << 26, slots_per_slab=4)
    yield a
    a.close()
