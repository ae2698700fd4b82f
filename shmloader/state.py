"""The loader's resume state: its format, its validation, and the epoch-start record.

``DataLoader.state_dict()`` returns a plain dict (ints, bools, strings, bytes, lists; no batch
data) that ``torch.save`` stores and ``torch.load(weights_only=True)`` reads back::

    format "shmloader.DataLoader", version 2 (version 1, which had no ``replicas``, still loads
                  for map-style datasets)
    fingerprint   what must match at load: dataset length, batches an epoch (``len(loader)``,
                  map-style), batch size and drop_last (the loader's and its batch sampler's;
                  these two and the batches absent from earlier states), sampler and batch
                  sampler types, num_workers, in_order, persistent_workers
    epoch         0-based number of the epoch in progress (in_epoch) or of the next one
    in_epoch      whether an epoch was in progress
    yielded       batches of that epoch consumed, in sampler order (a prefix)
    yielded_extra sampler positions past the prefix already consumed (in_order=False only)
    base_seed     the iterator's base seed, when the next batches come from an existing iterator
                  (an epoch in progress, or persistent workers); else None: drawn anew, as torch
    epoch_start   the RNG state the epoch's sampler draws started from (``EpochStart``); between
                  epochs, where the next epoch's draws start
    workers       per worker: its RNG snapshot (``shmloader.rngstate``) before the first batch
                  not consumed, or None where the worker's seed alone gives it
    replicas      IterableDatasets mid-epoch (else None): per worker (one entry with
                  num_workers=0) the batches of the epoch consumed from it and, for a dataset
                  with ``state_dict`` / ``load_state_dict``, its ``state_dict()`` after them
                  (and ``ended``: True when it ran out inside the last of them);
                  the workers of the tasks in flight and torch's round-robin pointer
                  (``shmloader.progress``)
    main_rng      the main process's torch / random / NumPy state at ``state_dict()``
    rewound_rngs  mid-epoch behind a DevicePrefetcher: that state before each draw the saved
                  run had made ahead of the batch the user had, oldest first, which the resumed
                  loader makes again, each from its state, leaving the global RNGs as they are:
                  with ``num_workers=0`` each fetch of the batches the prefetcher holds unseen;
                  with workers, the sampler draw that taking each of them made (states saved
                  before this key: [], and with workers ``main_rng`` was then as of before the
                  first of those draws, which a resumed loader made from it one after another)

Invariant: resuming from a state yields, bit for bit, the batches an uninterrupted run yields
after the save point (``in_order=True``; what README's "Resuming mid-epoch" lists aside, such
as a state another thread takes with ``num_workers=0`` after a resumed epoch was left early and
before the next ``iter()``); the epoch's sampler draws are replayed from ``epoch_start``
without touching the process's global RNGs, which ``main_rng`` then sets.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from shmloader import rngstate

FORMAT = "shmloader.DataLoader"
VERSION = 2
READS = (1, 2)  # versions load_state_dict accepts
ITER_KEYS = (
    "epoch",
    "in_epoch",
    "yielded",
    "yielded_extra",
    "base_seed",
    "epoch_start",
    "workers",
    "replicas",
)  # what the iterator knows
_KEYS = ("format", "version", "fingerprint", *ITER_KEYS, "main_rng")


def _type_name(obj: Any) -> str | None:
    return None if obj is None else f"{type(obj).__module__}.{type(obj).__qualname__}"


def batches_per_epoch(loader: Any) -> int | None:
    """``len(loader)`` for a map-style dataset whose sampler has a length; else None."""
    if isinstance(loader.dataset, torch.utils.data.IterableDataset):
        return None
    try:
        return len(loader)
    except TypeError:
        return None


def fingerprint(loader: Any) -> dict[str, Any]:
    """What a state must agree with to be loaded into ``loader``."""
    try:
        n: int | None = len(loader.dataset)
    except TypeError:
        n = None
    return {
        "dataset_len": n,
        "batch_size": loader.batch_size,
        "drop_last": loader.drop_last,
        "sampler": _type_name(loader.sampler),
        "batch_sampler": _type_name(loader.batch_sampler),
        "num_workers": loader.num_workers,
        "in_order": loader.in_order,
        "persistent_workers": loader.persistent_workers,
        # A batch_sampler= of torch's kind (loader.batch_size is None then), and what any other
        # difference in the sampling makes of an epoch; named after the keys above, which say
        # more when they differ too.
        "batch_sampler.batch_size": getattr(loader.batch_sampler, "batch_size", None),
        "batch_sampler.drop_last": getattr(loader.batch_sampler, "drop_last", None),
        "batches": batches_per_epoch(loader),
    }


_WHY = {
    "num_workers": (
        "each worker's random streams and torch's batch-to-worker assignment (batch i goes to "
        "worker i % num_workers) depend on it, so batches drawn with worker-side randomness "
        "could not match; resume with the num_workers the state was saved with"
    ),
    "persistent_workers": "worker random streams continue across epochs only with it",
    "batches": (
        "len(DataLoader), the batches an epoch: the batch size, drop_last or the sampler's "
        "length (num_samples, a DistributedSampler's num_replicas) differ"
    ),
}
# Keys added to the fingerprint after version 2 shipped: a state saved without one skips it.
_ADDED = frozenset({"batches", "batch_sampler.batch_size", "batch_sampler.drop_last"})


class StateMismatch(ValueError):
    """A loaded state that this loader cannot resume from, found only at ``iter()``."""


def check(loader: Any, sd: Any) -> dict[str, Any]:
    """Raise a clear error when ``sd`` is not a state this loader can resume from; else ``sd``
    in this version's form (a copy)."""
    if not isinstance(sd, dict) or sd.get("format") != FORMAT:
        raise ValueError(
            "not a shmloader DataLoader state: expected a dict from DataLoader.state_dict() "
            f"with format {FORMAT!r}, got {type(sd).__name__}"
            + (f" with format {sd.get('format')!r}" if isinstance(sd, dict) else "")
        )
    if sd.get("version") not in READS:
        raise ValueError(
            f"DataLoader state version {sd.get('version')!r} is not supported (this shmloader "
            f"reads versions {', '.join(map(str, READS))})"
        )
    if sd["version"] == 1:
        if isinstance(loader.dataset, torch.utils.data.IterableDataset) and sd.get("in_epoch"):
            raise ValueError(
                "this DataLoader state (version 1, from an earlier shmloader) was saved mid-epoch "
                "over an IterableDataset without its replicas' progress, so it cannot resume "
                "exactly; resume from a state saved by this version, or from an epoch boundary"
            )
        sd = {**sd, "replicas": None}
    missing = [k for k in _KEYS if k not in sd]
    if missing:
        raise ValueError(f"corrupted DataLoader state: missing {', '.join(missing)}")
    _check_types(sd)
    want = fingerprint(loader)
    for key, value in want.items():
        if key in _ADDED and key not in sd["fingerprint"]:
            continue
        got = sd["fingerprint"].get(key)
        if got != value:
            why = _WHY.get(key)
            raise ValueError(
                f"DataLoader state mismatch: it was saved with {key}={got!r}, but this loader "
                f"has {key}={value!r}" + (f" ({why})" if why else "")
            )
    if len(sd["workers"]) != max(loader.num_workers, 0) and sd["workers"]:
        raise ValueError(
            f"corrupted DataLoader state: {len(sd['workers'])} worker RNG states for "
            f"num_workers={loader.num_workers}"
        )
    n = want["batches"]
    if n is not None and (sd["yielded"] > n or any(p >= n for p in sd["yielded_extra"])):
        raise ValueError(
            f"corrupted DataLoader state: {sd['yielded']} batches consumed (and positions "
            f"{sd['yielded_extra']} past them) in an epoch of {n} batches"
        )
    if sd["yielded_extra"] and loader.in_order:
        raise ValueError(
            f"corrupted DataLoader state: positions {sd['yielded_extra']} consumed past the "
            "first 'yielded', which only an in_order=False loader records"
        )
    rep = sd["replicas"]
    nw = max(loader.num_workers, 1)
    if rep is not None and len(rep["workers"]) != nw:
        raise ValueError(
            f"corrupted DataLoader state: {len(rep['workers'])} IterableDataset replicas for "
            f"num_workers={loader.num_workers}"
        )
    if rep is not None and not (
        all(0 <= w < nw for w in rep["assign"]) and 0 <= rep["next_worker"] < nw
    ):
        raise ValueError(
            f"corrupted DataLoader state: IterableDataset tasks assigned to workers "
            f"{rep['assign']}, next worker {rep['next_worker']}, with num_workers="
            f"{loader.num_workers}"
        )
    # Now, not at the first iter(): by then load_state_dict() has set the global RNGs.
    es = sd["epoch_start"]
    for what, saved, have in (
        ("torch.Generators", es["generators"], generators(loader)),
        ("stateful samplers", es["samplers"], stateful_samplers(loader)),
    ):
        if set(saved) != set(have):
            raise ValueError(
                f"DataLoader state mismatch: it was saved with {what} at {sorted(saved)}, but "
                f"this loader has them at {sorted(have)}"
            )
    return dict(sd)


def _check_types(sd: dict[str, Any]) -> None:
    def bad(key: str, what: str) -> ValueError:
        return ValueError(f"corrupted DataLoader state: {key} must be {what}, got {sd[key]!r:.80}")

    for key in ("epoch", "yielded"):
        if type(sd[key]) is not int or sd[key] < 0:
            raise bad(key, "an int >= 0")
    if type(sd["in_epoch"]) is not bool:
        raise bad("in_epoch", "a bool")
    if not isinstance(sd["fingerprint"], dict):
        raise bad("fingerprint", "a dict")
    if sd["base_seed"] is not None and (
        type(sd["base_seed"]) is not int or not 0 <= sd["base_seed"] < 1 << 63
    ):  # torch draws it as a non-negative int64 (a larger one killed the workers: review 45)
        raise bad("base_seed", "an int in [0, 2**63) or None")
    if not isinstance(sd["yielded_extra"], list) or any(
        type(p) is not int or p <= sd["yielded"] for p in sd["yielded_extra"]
    ):
        raise bad("yielded_extra", "a list of positions past 'yielded'")
    from shmloader.rngstate import SNAPSHOT

    rep = sd["replicas"]
    if rep is not None and not (
        isinstance(rep, dict)
        and isinstance(rep.get("workers"), list)
        and all(
            isinstance(w, dict) and type(w.get("batches")) is int and w["batches"] >= 0
            for w in rep["workers"]
        )
        and all(
            w.get("epoch_rng") is None
            or (type(w["epoch_rng"]) is bytes and len(w["epoch_rng"]) == SNAPSHOT)
            for w in rep["workers"]
        )
        and all(type(w.get("ended", False)) is bool for w in rep["workers"])
        and isinstance(rep.get("assign"), list)
        and all(type(w) is int for w in rep["assign"])
        and type(rep.get("next_worker")) is int
    ):
        raise bad(
            "replicas",
            "None or a dict of workers (batches, epoch_rng snapshots, ended flags), assign and "
            "next_worker",
        )
    if not isinstance(sd["workers"], list) or any(
        w is not None and (type(w) is not bytes or len(w) != SNAPSHOT) for w in sd["workers"]
    ):
        raise bad("workers", f"a list of None or {SNAPSHOT}-byte snapshots")
    if type(sd["main_rng"]) is not bytes or len(sd["main_rng"]) != SNAPSHOT:
        raise bad("main_rng", f"a {SNAPSHOT}-byte snapshot")
    rewound = sd.get("rewound_rngs", [])
    if not isinstance(rewound, list) or any(
        type(r) is not bytes or len(r) != SNAPSHOT for r in rewound
    ):
        raise bad("rewound_rngs", f"a list of {SNAPSHOT}-byte snapshots")
    if rewound and not sd["in_epoch"]:
        raise bad("rewound_rngs", "empty between epochs")
    es = sd["epoch_start"]
    if not isinstance(es, dict) or type(es.get("torch_rng")) is not bytes:
        raise bad("epoch_start", "a dict with torch_rng bytes")
    if not isinstance(es.get("generators"), dict) or not isinstance(es.get("samplers"), dict):
        raise bad("epoch_start", "a dict with generators and samplers dicts")
    rngs = es.get("rngs")  # (absent from states saved before it was added)
    if rngs is not None and (type(rngs) is not bytes or len(rngs) != SNAPSHOT):
        raise bad("epoch_start", f"a dict whose rngs is a {SNAPSHOT}-byte snapshot")
    if type(es.get("before_init", False)) is not bool:  # (absent from earlier states, too)
        raise bad("epoch_start", "a dict whose before_init is a bool")


# -- the RNG objects a loader draws from ---------------------------------------------------------


def generators(loader: Any) -> dict[str, torch.Generator]:
    """The distinct ``torch.Generator``s of the loader and its samplers, by attribute path."""
    out: dict[str, torch.Generator] = {}
    seen: set[int] = set()
    bs = loader.batch_sampler
    inner = getattr(bs, "sampler", None)
    candidates = [
        ("generator", loader.generator),
        ("sampler.generator", getattr(loader.sampler, "generator", None)),
        ("batch_sampler.generator", getattr(bs, "generator", None)),
        ("batch_sampler.sampler.generator", getattr(inner, "generator", None)),
    ]  # fmt: skip
    for path, gen in candidates:
        if isinstance(gen, torch.Generator) and id(gen) not in seen:
            seen.add(id(gen))
            out[path] = gen
    return out


def is_stateful(obj: Any) -> bool:
    """Whether ``obj`` follows torchdata's Stateful protocol (``state_dict`` and
    ``load_state_dict``)."""
    return callable(getattr(obj, "state_dict", None)) and callable(
        getattr(obj, "load_state_dict", None)
    )


def stateful_samplers(loader: Any) -> dict[str, Any]:
    """The loader's distinct samplers that implement ``state_dict`` / ``load_state_dict``
    (also the sampler inside a ``batch_sampler`` without them, such as torch's BatchSampler)."""
    bs = loader.batch_sampler
    pairs = [("sampler", loader.sampler), ("batch_sampler", bs)]
    if not is_stateful(bs):
        pairs.append(("batch_sampler.sampler", getattr(bs, "sampler", None)))
    out: dict[str, Any] = {}
    seen: set[int] = set()
    for path, obj in pairs:
        if is_stateful(obj) and id(obj) not in seen:
            seen.add(id(obj))
            out[path] = obj
    return out


def generator_states(loader: Any) -> dict[str, bytes]:
    return {p: bytes(g.get_state().numpy().tobytes()) for p, g in generators(loader).items()}


def set_generator_states(loader: Any, states: dict[str, bytes]) -> None:
    gens = generators(loader)
    if set(gens) != set(states):
        raise ValueError(
            f"DataLoader state mismatch: it was saved with torch.Generators at {sorted(states)}, "
            f"but this loader has them at {sorted(gens)}"
        )
    for path, st in states.items():
        gens[path].set_state(torch.frombuffer(bytearray(st), dtype=torch.uint8))


@dataclass
class EpochStart:
    """What an epoch's sampler draws start from: the global torch, ``random`` and NumPy RNGs
    (after the iterator's base seed draw), the loader's generators, and custom samplers' own
    ``state_dict()`` (a copy: a sampler may change the dict it returned).

    ``before_init``: captured before the iterator's ``__init__`` (``num_workers=0``), so its
    replay runs that ``__init__`` again: ``iter()`` of the index sampler (a sampler that draws
    in ``__iter__`` draws there), the base seed, ``iter()`` of an IterableDataset, in torch's
    order. States saved before it existed lack it: captured after ``__init__``."""

    torch_rng: bytes
    generators: dict[str, bytes] = field(default_factory=dict)
    samplers: dict[str, Any] = field(default_factory=dict)
    rngs: bytes | None = None  # rngstate snapshot of all three global RNGs
    before_init: bool = False

    @classmethod
    def capture(cls, loader: Any, before_init: bool = False) -> EpochStart:
        return cls(
            bytes(torch.get_rng_state().numpy().tobytes()),
            generator_states(loader),
            {p: copy.deepcopy(s.state_dict()) for p, s in stateful_samplers(loader).items()},
            rngstate.capture(),
            before_init,
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "torch_rng": self.torch_rng,
            "generators": self.generators,
            "samplers": self.samplers,
            "rngs": self.rngs,
            "before_init": self.before_init,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> EpochStart:
        return cls(
            d["torch_rng"],
            dict(d["generators"]),
            dict(d["samplers"]),
            d.get("rngs"),
            d.get("before_init", False),
        )

    def apply(self, loader: Any) -> None:
        """Put the loader's generators and stateful samplers in this state."""
        set_generator_states(loader, self.generators)
        samplers = stateful_samplers(loader)
        if set(samplers) != set(self.samplers):
            raise ValueError(
                f"DataLoader state mismatch: it was saved with stateful samplers at "
                f"{sorted(self.samplers)}, but this loader has them at {sorted(samplers)}"
            )
        for path, st in self.samplers.items():
            samplers[path].load_state_dict(st)

    @contextlib.contextmanager
    def replay(self, loader: Any) -> Iterator[None]:
        """Inside: the loader's generators and samplers and the global RNGs are where the
        epoch's draws started (a sampler drawing from ``random`` or NumPy replays too); on exit
        the global RNGs are what they were before."""
        self.apply(loader)
        saved = rngstate.capture()
        try:
            if self.rngs is not None:
                rngstate.restore(self.rngs)
            else:
                torch.set_rng_state(torch.frombuffer(bytearray(self.torch_rng), dtype=torch.uint8))
            yield
        finally:
            rngstate.restore(saved)


def skip_consumed(next_index: Any, batches: int) -> None:
    """Draw the indices of the ``batches`` a resumed epoch consumed before its save; a sampler
    that ends first (a state from another sampler) raises :class:`StateMismatch`."""
    for k in range(batches):
        try:
            next_index()
        except StopIteration:
            raise StateMismatch(
                f"DataLoader state mismatch: it was saved after {batches} batches of an epoch, "
                f"but this loader's sampler ends after {k}; resume with the sampler, batch size "
                "and dataset the state was saved with"
            ) from None


@contextlib.contextmanager
def untouched_rngs(loader: Any) -> Iterator[None]:
    """Draws made inside (the base seed of a resumed iterator, and whatever ``iter()`` of its
    sampler or dataset draws) leave the global torch, ``random`` and NumPy RNGs and the loader's
    generators as they were."""
    saved = generator_states(loader)
    rngs = rngstate.capture()
    try:
        yield
    finally:
        rngstate.restore(rngs)
    set_generator_states(loader, saved)
