"""The ``arena_*`` arguments: checked once at construction, errors naming the argument and fix."""

import numpy as np
import pytest
import torch

import shmloader
from arena import PAGE, Backend
from shmloader.options import ArenaOptions, arena_options


class Ramp(torch.utils.data.Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, i):
        return torch.tensor(i)


def test_defaults_are_auto_backend_and_no_caps():
    assert arena_options("auto", None, None) == ArenaOptions(Backend.AUTO, None, None)


@pytest.mark.parametrize("integral", [np.int64(1 << 30), np.int32(1 << 20), np.uint64(1 << 30)])
def test_any_integral_type_is_accepted_for_arena_max_bytes_as_a_plain_int(integral):
    loader = shmloader.DataLoader(Ramp(), num_workers=2, arena_max_bytes=integral)
    assert loader.arena_options.max_bytes == int(integral)
    assert type(loader.arena_options.max_bytes) is int


def test_any_integral_type_is_accepted_for_arena_slots_per_slab():
    loader = shmloader.DataLoader(Ramp(), num_workers=2, arena_slots_per_slab=np.int16(3))
    assert loader.arena_options.slots_per_slab == 3
    assert type(loader.arena_options.slots_per_slab) is int


@pytest.mark.parametrize(
    ("name", "value", "hint"),
    [
        ("arena_slots_per_slab", 2.0, "arena_slots_per_slab=4"),
        ("arena_slots_per_slab", True, "arena_slots_per_slab=4"),
        ("arena_max_bytes", 1e9, "arena_max_bytes=8 * 2**30"),
        ("arena_max_bytes", "1GB", "arena_max_bytes=8 * 2**30"),
    ],
)
def test_a_non_integer_is_a_type_error_whose_hint_names_the_same_argument(name, value, hint):
    with pytest.raises(TypeError) as info:
        shmloader.DataLoader(Ramp(), num_workers=2, **{name: value})
    message = str(info.value)
    assert message.startswith(f"{name} must be an integer or None, got {value!r}")
    assert hint in message
    other = ({"arena_max_bytes", "arena_slots_per_slab"} - {name}).pop()
    assert other not in message


@pytest.mark.parametrize("cap", [1, 100, PAGE - 1])
def test_a_cap_below_one_page_is_rejected_at_construction_with_the_numbers(cap):
    with pytest.raises(ValueError) as info:
        shmloader.DataLoader(Ramp(), num_workers=2, arena_max_bytes=cap)
    assert f"arena_max_bytes={cap:,} is below one page ({PAGE:,} bytes)" in str(info.value)
    assert "8 * 2**30" in str(info.value)


def test_a_cap_of_exactly_one_page_is_accepted():
    assert arena_options("auto", PAGE, None).max_bytes == PAGE


def test_the_planned_cap_is_the_given_one_or_half_the_available_ram():
    assert arena_options("auto", 1 << 20, None).planned_max_bytes() == 1 << 20
    assert arena_options("posix", None, None).planned_max_bytes() > 0
