"""What a new user meets first: importable errors, release()'s arguments, empty()'s keywords."""

import numpy as np
import pytest
import torch

import arena.errors
import shmloader
from shmloader.collate import SlotSession


class Rows(torch.utils.data.Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        return torch.full((16,), i, dtype=torch.float32)


# ------------------------------------------------------------------------------ errors


@pytest.mark.parametrize(
    "name", ["ArenaError", "ArenaCapacityError", "ArenaExhaustedError", "StaleSlotError"]
)
def test_every_arena_error_is_importable_from_shmloader_and_is_the_same_class(name):
    assert getattr(shmloader, name) is getattr(arena.errors, name)
    assert name in shmloader.__all__


def test_every_error_class_in_arena_errors_is_exported():
    defined = {n for n, v in vars(arena.errors).items()
               if isinstance(v, type) and issubclass(v, Exception)}
    assert defined <= set(shmloader.__all__)


def test_the_errors_can_be_caught_as_the_base_and_as_runtime_error():
    assert issubclass(shmloader.ArenaExhaustedError, shmloader.ArenaError)
    assert issubclass(shmloader.ArenaCapacityError, RuntimeError)


# ------------------------------------------------------------------------------ release()


def test_release_with_a_torch_loader_says_its_batches_own_their_memory():
    loader = torch.utils.data.DataLoader(Rows(), batch_size=4)
    batch = next(iter(loader))
    with pytest.raises(TypeError, match="drop your references to the batch instead"):
        shmloader.release(batch, loader)


@pytest.mark.parametrize("make", [torch.utils.data.DataLoader, shmloader.DataLoader])
def test_release_with_the_arguments_swapped_names_the_order(make):
    loader = make(Rows(), batch_size=4)
    batch = next(iter(loader))
    with pytest.raises(TypeError, match=r"takes the batch first and the loader second"):
        shmloader.release(loader, batch)


def test_release_with_something_else_as_the_loader_names_its_type():
    with pytest.raises(TypeError, match="as its second argument, got dict"):
        shmloader.release(torch.zeros(2), {})


def test_release_with_no_workers_returns_zero_and_leaves_the_batch_intact():
    loader = shmloader.DataLoader(Rows(), batch_size=4, num_workers=0)
    batch = next(iter(loader))
    assert shmloader.release(batch, loader) == 0
    assert torch.equal(batch[0], torch.zeros(16))


def test_release_with_workers_returns_the_slot_once():
    loader = shmloader.DataLoader(Rows(), batch_size=4, num_workers=1)
    it = iter(loader)
    batch = next(it)
    assert shmloader.release(batch, loader) == 1
    assert shmloader.release(batch, loader) == 0
    assert loader.stats().batches_held == 0
    del batch, it


# ------------------------------------------------------------------------------ empty()


@pytest.mark.parametrize(
    ("args", "kwargs", "shape"),
    [
        ((), {"size": (2, 3)}, (2, 3)),
        ((), {"size": torch.Size([4])}, (4,)),
        (((2, 3),), {"device": "cpu"}, (2, 3)),
        ((2, 3), {"device": torch.device("cpu")}, (2, 3)),
        ((np.int64(5),), {}, (5,)),
        ((2,), {"pin_memory": False, "requires_grad": False, "layout": torch.strided}, (2,)),
        ((2,), {"memory_format": torch.contiguous_format, "out": None}, (2,)),
        (([],), {}, ()),
    ],
)
def test_empty_takes_torch_empty_keywords_that_make_sense_in_a_worker(args, kwargs, shape):
    assert shmloader.empty(*args, **kwargs).shape == torch.empty(*args, **kwargs).shape == shape


def test_empty_with_size_and_dtype_keywords_allocates_inside_the_slot(arena):
    ref = arena.acquire(8192)
    with SlotSession(arena.slot_buffer(ref)) as s:
        t = shmloader.empty(size=(4, 4), dtype=torch.int32, device="cpu")
        assert t.shape == (4, 4) and t.dtype == torch.int32
        assert s.holds(t.data_ptr(), t.numel() * 4)


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"pin_memory": True}, "pass pin_memory=True to the DataLoader"),
        ({"requires_grad": True}, "set requires_grad on the batch the loader yields"),
        ({"layout": torch.sparse_coo}, "strided tensors only"),
        ({"memory_format": torch.channels_last}, "contiguous tensors only"),
        ({"out": torch.empty(2)}, "write into the tensor shmloader.empty() returns"),
        ({"bogus": 1}, "empty() got an unexpected keyword argument 'bogus'"),
        ({"dtype": "float32"}, "empty(): argument 'dtype' must be torch.dtype, not str"),
    ],
)
def test_empty_rejects_what_a_slot_cannot_honour_in_and_out_of_a_worker(kwargs, words, arena):
    with pytest.raises(TypeError) as outside:
        shmloader.empty(2, **kwargs)
    ref = arena.acquire(4096)
    with SlotSession(arena.slot_buffer(ref)), pytest.raises(TypeError) as inside:
        shmloader.empty(2, **kwargs)
    assert words in str(outside.value)
    assert str(inside.value) == str(outside.value)


def test_empty_on_a_gpu_device_says_the_slot_is_cpu_memory_and_how_to_move_the_batch():
    with pytest.raises(ValueError, match=r"CPU memory; got device='cuda'.*batch.to\('cuda'"):
        shmloader.empty(2, device="cuda")


@pytest.mark.parametrize(
    ("args", "kwargs", "words"),
    [
        ((2.0,), {}, "must be tuple of ints, but found element of type float at pos 0"),
        (((2, True),), {}, "found element of type bool at pos 1"),
        (((2,),), {"size": (2,)}, "got multiple values for argument 'size'"),
        ((), {}, 'missing 1 required positional arguments: "size"'),
    ],
)
def test_a_bad_size_raises_a_type_error_in_torchs_words(args, kwargs, words):
    with pytest.raises(TypeError, match="empty") as info:
        shmloader.empty(*args, **kwargs)
    assert words in str(info.value)
