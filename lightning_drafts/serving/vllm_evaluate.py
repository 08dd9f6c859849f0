"""``evaluate --engine vllm``: an export served by a real vLLM engine, its rounds read back as the built-in
decode reports them, so one report (accept_len, per-position rates, lossless check) covers both engines.

vLLM loads the target from a directory (or hub id) and the draft from the export directory, with the
speculative method its family record names (:attr:`~lightning_drafts.serving.family.DraftFamily.vllm_methods`).
A target that exists only in memory (a random config-dict target, a model instance) is saved to a scratch
directory first, so vLLM verifies with the very weights the built-in decode uses.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch
from torch import Tensor
from transformers import PreTrainedModel

from lightning_drafts.serving.family import DraftFamily
from lightning_drafts.serving.sampling import Sampling
from lightning_drafts.serving.vllm_engine import VLLMRequest, VLLMResult, run_vllm_all
from lightning_drafts.training.target import FrozenTarget, TargetSpec

# Our dtype names -> vLLM's ``dtype``. None is float32: vLLM's own ``auto`` casts a float32 checkpoint down to
# 16 bits, where the built-in decode keeps it in float32.
VLLM_DTYPES = {
    None: "float32",
    "float32": "float32",
    "fp32": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
}

# What serves the prompts in a run of vLLM: the export, the target alone, or vLLM's n-gram speculator.
VLLM_MODES = ("draft", "target", "ngram")


def serve_with_vllm(
    family: DraftFamily,
    export_dir: Path,
    architecture: str,
    target: FrozenTarget | TargetSpec | None,
    frozen: FrozenTarget,
    prompts: Sequence[Tensor],
    num_steps: int,
    max_new_tokens: int,
    stop_token_ids: Iterable[int],
    dtype: str | None = None,
    python: str | Path | None = None,
    progress: bool = False,
    modes: Sequence[str] = ("draft",),
    groups: Sequence[Sequence[int]] | None = None,
    sampling: Sampling | None = None,
    seed: int = 0,
) -> dict[str, VLLMResult]:
    """Speculative decoding of ``prompts`` by vLLM, greedy or with ``sampling`` from the export in ``export_dir``: per mode, what
    vLLM generated, with its rounds (``as_generations()`` gives them as the built-in decode reports them).

    Args:
        target: the target as ``evaluate`` was given it (``None``: the one the export records).
        frozen: that target, built; saved for vLLM when it is not a directory or hub id vLLM can load.
        stop_token_ids: end a generation after any of these (vLLM's end-of-sequence rule is off, so both
            engines stop on exactly the same tokens).
        dtype: the target dtype (``None``: float32).
        python: the vLLM environment's python (default: found as ``run_vllm`` finds it).
        modes: engines to run, one after another in one vLLM process: ``"draft"`` (the export drafts),
            ``"target"`` (the target alone, no speculation), ``"ngram"`` (vLLM's n-gram speculator drafts
            ``num_steps`` tokens from the prompt).
        groups: prompt indices generated and timed together (``VLLMRequest.groups``).
        sampling: temperature and top-p (``None``: greedy); prompt ``i`` draws from vLLM's per-request
            generator seeded ``seed + i``, as the built-in decode seeds its own.
    """
    unknown = [mode for mode in modes if mode not in VLLM_MODES]
    if unknown:
        raise ValueError(f"modes {unknown} are unknown; choose among {VLLM_MODES}")
    methods = {"draft": family.vllm_method(architecture), "target": None, "ngram": "ngram"}
    if dtype not in VLLM_DTYPES:
        raise ValueError(
            f"target dtype {dtype!r} has no vLLM name; use one of {sorted(k for k in VLLM_DTYPES if k)}"
        )
    with tempfile.TemporaryDirectory(prefix="lightning-drafts-vllm-target-") as scratch:
        loadable = _loadable_target(target, frozen, Path(scratch))
        requests = [
            VLLMRequest(
                target=loadable,
                draft=str(export_dir) if mode == "draft" else None,
                method=methods[mode],
                num_speculative_tokens=num_steps,
                prompts=[p.tolist() for p in prompts],
                max_new_tokens=max_new_tokens,
                stop_token_ids=sorted(set(stop_token_ids)),
                ignore_eos=True,
                dtype=VLLM_DTYPES[dtype],
                groups=groups,
                # Timed groups: the engine's first-call compilation stays out of tokens/s.
                warmup=groups is not None,
                **(
                    {}
                    if sampling is None
                    else {
                        "temperature": sampling.temperature,
                        "top_p": sampling.top_p,
                        "seeds": [seed + i for i in range(len(prompts))],
                    }
                ),
            )
            for mode in modes
        ]
        results = run_vllm_all(requests, python=python, progress=progress)
    return dict(zip(modes, results, strict=True))


def _loadable_target(target: FrozenTarget | TargetSpec | None, frozen: FrozenTarget, scratch: Path) -> str:
    """A directory or hub id holding ``frozen``'s weights, for vLLM to load."""
    # An instance may have been changed in memory since it was loaded: only its saved weights are certain.
    if not isinstance(target, (FrozenTarget, PreTrainedModel)):
        source = str(getattr(frozen.model, "name_or_path", "") or "")
        if source and (Path(source).is_dir() or not Path(source).exists()):
            return source
    directory = scratch / "target"
    with torch.no_grad():
        frozen.model.save_pretrained(directory)
    return str(directory)
