"""The options of the target on its own Ray workers, as one model argument.

A config names them as one block under the model's ``init_args`` (``remote: {workers: 2, cache_dir:
features/eagle3}``), the command line as ``--model.init_args.remote.workers 2``. The argument is a plain
dict (:class:`RemoteOptions`), so checkpoints record it as data; :class:`RemoteTargetConfig` is the same
options checked, with their defaults.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, TypedDict

from lightning_drafts.core.checks import check_number
from lightning_drafts.training.features_manifest import storage_dtype

# The flat names these options had as model arguments; a checkpoint written with them still loads.
RETIRED_NAMES = {
    "target_workers": "workers",
    "target_address": "address",
    "target_prefetch": "prefetch",
    "target_max_mb_in_flight": "max_mb_in_flight",
    "target_worker_gpus": "worker_gpus",
    "target_unit_timeout_s": "unit_timeout_s",
    "target_cache_dir": "cache_dir",
    "target_cache_dtype": "cache_dtype",
}


class RemoteOptions(TypedDict, total=False):
    """The ``remote`` model argument: any of :class:`RemoteTargetConfig`'s fields."""

    workers: int
    address: str | None
    prefetch: int
    max_mb_in_flight: float
    worker_gpus: float
    unit_timeout_s: float | None
    cache_dir: str | None
    cache_dtype: str


@dataclass(frozen=True)
class RemoteTargetConfig:
    """The target on its own Ray workers (docs/guides/disaggregated.md).

    Args:
        workers: run the target on this many Ray workers instead of in the trainer's process (0, the
            default: it runs in the trainer). Every batch then carries the target features a worker
            computed for its exact rows, and the trainer keeps only the target's embedding, final norm and
            LM head. A local Ray is started for the run unless ``address`` names a cluster.
        address: the Ray cluster's address (``ray start --head`` prints it).
        prefetch: micro-batches sent to the workers ahead of the one being trained on.
        max_mb_in_flight: cap on the feature bytes (MiB) sent for or waiting to be trained on.
        worker_gpus: GPUs per worker (0 on CPU machines).
        unit_timeout_s: send a unit again, to another worker, when its features are this many seconds late
            (``None``: only when its worker died); a late first result that still arrives is dropped.
        cache_dir: online, then cached: write the features the workers send into this features directory
            (the layout and manifest of ``lightning-drafts capture``) and, once the first epoch has run
            through, train every later epoch from it without the workers (a later run of the same config
            finds it complete and starts none). One trainer rank only.
        cache_dtype: its storage dtype (``bfloat16``, ``float16``, ``float32`` or ``float8_e4m3fn``).
    """

    workers: int = 0
    address: str | None = None
    prefetch: int = 4
    max_mb_in_flight: float = 256.0
    worker_gpus: float = 0.0
    unit_timeout_s: float | None = None
    cache_dir: str | None = None
    cache_dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        if not isinstance(self.workers, int) or self.workers < 0:
            raise ValueError(
                f"remote.workers = {self.workers!r}; it must be an integer >= 0 (0 runs the target here)"
            )
        if self.address is not None and not self.workers:
            raise ValueError(
                f"remote.address = {self.address!r} names the Ray cluster of the target workers, but remote.workers "
                "= 0, so the target runs here and the address would be ignored; set remote.workers (e.g. 1), or "
                "drop remote.address"
            )
        if self.cache_dir is not None and not self.workers:
            raise ValueError(
                f"remote.cache_dir = {self.cache_dir!r} caches what target workers send, but remote.workers = 0; "
                "set remote.workers, or capture with `lightning-drafts capture`"
            )
        if not isinstance(self.prefetch, int) or self.prefetch < 0:
            raise ValueError(f"remote.prefetch = {self.prefetch!r}; it must be an integer >= 0")
        check_number("remote.max_mb_in_flight", self.max_mb_in_flight, minimum=0, above_minimum=True)
        check_number("remote.worker_gpus", self.worker_gpus, minimum=0)
        if self.unit_timeout_s is not None:
            check_number("remote.unit_timeout_s", self.unit_timeout_s, minimum=0, above_minimum=True)
        storage_dtype(self.cache_dtype)

    @classmethod
    def of(cls, value: Mapping[str, Any] | None) -> RemoteTargetConfig:
        """The checked options of the ``remote`` model argument (``None``: the target runs here)."""
        if value is None:
            return cls()
        if not isinstance(value, Mapping):
            raise ValueError(f"remote = {value!r}; give a mapping of {[f.name for f in fields(cls)]}")
        unknown = sorted(set(value) - {f.name for f in fields(cls)})
        if unknown:
            raise ValueError(
                f"remote has no option {unknown[0]!r}; its options are {[f.name for f in fields(cls)]}"
            )
        return cls(**value)


def with_retired(remote: Mapping[str, Any] | None, retired: Mapping[str, Any]) -> dict[str, Any] | None:
    """The ``remote`` argument with the options a checkpoint recorded under their retired flat names
    (``retired``, e.g. ``target_workers``); refuses any other unexpected argument as Python would."""
    unknown = sorted(set(retired) - set(RETIRED_NAMES))
    if unknown:
        raise TypeError(f"DraftModule.__init__() got an unexpected keyword argument {unknown[0]!r}")
    if not retired:
        return None if remote is None else dict(remote)
    return {**{RETIRED_NAMES[name]: value for name, value in retired.items()}, **(remote or {})}
