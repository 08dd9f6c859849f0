"""The random draws of one training or validation step (a block draft's anchors and variable prefixes),
made from a generator of their own instead of the global RNG.

The global RNG is not in a checkpoint, and whatever else consumed it before (validation, the data loader,
a callback) shifts every later draw: a run resumed from a checkpoint drew other anchors than the run it
continues. A generator seeded by the run's seed, the stage, the global step, the rank and the micro-batch
draws the same numbers for the same micro-batch however the run got there: uninterrupted, resumed after a
SIGTERM or a SIGKILL, or with the target on remote workers.
"""

from __future__ import annotations

import hashlib
import json
import os

import torch

# Where ``lightning.seed_everything`` (the CLI's ``seed_everything``) records the run's seed.
GLOBAL_SEED_ENV = "PL_GLOBAL_SEED"


def run_seed() -> int:
    """The run's ``seed_everything`` seed, 0 when none was set."""
    raw = os.environ.get(GLOBAL_SEED_ENV, "0")
    try:
        return int(raw)
    except ValueError:
        raise ValueError(
            f"{GLOBAL_SEED_ENV}={raw!r} is not an integer seed; set seed_everything to an integer"
        ) from None


def step_generator(seed: int, stage: str, step: int, rank: int, micro_batch: int) -> torch.Generator:
    """A CPU generator for one micro-batch: the same arguments give the same draws, different ones
    independent draws (the key is hashed, so neighbouring steps get unrelated seeds). On the CPU whatever the
    training device, so a run draws the same on CPU and GPU and a CUDA generator's state never matters."""
    key = json.dumps([int(seed), stage, int(step), int(rank), int(micro_batch)]).encode()
    value = int.from_bytes(hashlib.sha256(key).digest()[:8], "little") & (2**63 - 1)
    return torch.Generator(device="cpu").manual_seed(value)


def micro_batch_generator(
    stage: str, batch_idx: int, step: int, rank: int, accumulate: int
) -> torch.Generator:
    """The generator of one training or validation micro-batch of the running fit: :func:`step_generator`
    of the run's seed. A training step's micro-batches are told apart by their place in its gradient
    accumulation (``batch_idx`` counts on across steps); validation's by their index, since the global step
    stays put while it runs."""
    micro_batch = batch_idx % accumulate if stage == "train" else batch_idx
    return step_generator(run_seed(), stage, step, rank, micro_batch)
