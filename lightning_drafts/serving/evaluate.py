"""Serving-faithful acceptance of an **exported** draft directory, for a given family.

Training metrics can look excellent while the exported draft accepts about one token in vLLM / SGLang
(wrong captured layers, a missing LM head, ``d2t`` read differently, RoPE settings lost). This measures
what serving would see: it validates the export, loads it through its family's loader (the files an
engine reads, not the in-memory module), drafts with it (:mod:`lightning_drafts.serving.decode`),
verifies with the frozen target, and reports the real acceptance next to the training-time estimate of
the same checkpoint on the same prompts (:mod:`lightning_drafts.serving.report`). With ``engine="vllm"`` a
real vLLM engine drafts and verifies instead (:mod:`lightning_drafts.serving.vllm_evaluate`), and the same
report is built from its rounds.

:func:`lightning_drafts.workflows.evaluate.evaluate_export` finds the family of an export by itself.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from lightning_drafts.core.checks import check_int
from lightning_drafts.serving.decode import as_prompt, greedy_generate, speculative_generate
from lightning_drafts.serving.export_files import CONFIG_FILE, read_export
from lightning_drafts.serving.family import DraftFamily
from lightning_drafts.serving.progress import announce, map_with_progress
from lightning_drafts.serving.report import EvaluationReport, served_acceptance, training_estimate
from lightning_drafts.serving.vllm_evaluate import serve_with_vllm
from lightning_drafts.training.target import FrozenTarget, TargetSpec

ENGINES = ("builtin", "vllm")


def evaluate_family_export(
    family: DraftFamily,
    export_dir: str | Path,
    prompts: Sequence[Tensor | Sequence[int]],
    target: FrozenTarget | TargetSpec | None = None,
    max_new_tokens: int = 64,
    num_steps: int | None = None,
    stop_token_ids: Iterable[int] | None = None,
    with_training_estimate: bool = True,
    check_lossless: bool = False,
    target_seed: int | None = None,
    target_attn_backend: str = "sdpa",
    target_dtype: str | None = None,
    device: str | torch.device | None = None,
    engine: str = "builtin",
    vllm_python: str | Path | None = None,
    progress: bool = False,
) -> EvaluationReport:
    """Validate, load and serve ``family``'s export in ``export_dir`` on ``prompts``; report served vs
    training acceptance.

    Args:
        prompts: token-id prompts (1-D tensors or lists), in the target's vocabulary.
        target: a :class:`FrozenTarget` (shared, e.g. by a training run), a hub id / path / config dict,
            or ``None`` for the target the export records.
        num_steps: tokens proposed per round (``None``: the family default, e.g. EAGLE-3's ``ttt_length``).
        stop_token_ids: end a generation after any of these (``None``: the target's ``eos_token_id``).
        with_training_estimate: also compute tau_sim of the same checkpoint on the same documents.
        check_lossless: also run the target's plain greedy decode and compare token for token.
        target_attn_backend: for a target built here; every forward holds one sequence, so plain causal
            SDPA serves on CPU and GPU alike (no packing kernel, no compilation).
        engine: ``"builtin"`` (:mod:`lightning_drafts.serving.decode`) or ``"vllm"``: a real vLLM engine in
            its own environment (:mod:`lightning_drafts.serving.vllm_evaluate`) serves the export; the
            lossless check and the training estimate still use the target built here.
        vllm_python: the vLLM environment's python (default: ``$LIGHTNING_DRAFTS_VLLM_PYTHON``, else
            ``.venv-vllm``).
        progress: show prompts done and tokens/s on stderr while decoding (only on a terminal).
    """
    if engine not in ENGINES:
        raise ValueError(f"engine={engine!r} is unknown; choose one of {ENGINES}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 1")
    if not prompts:
        raise ValueError("no prompts to evaluate on; pass at least one token-id prompt")
    directory = Path(export_dir)
    say = announce if progress else (lambda message: None)
    config = read_export(directory).config
    say(f"evaluate: loading the target ({_target_name(target, config)})")
    frozen = resolve_target(target, config, directory, target_seed, target_attn_backend, target_dtype, device)
    say(f"evaluate: validating the export {directory}")
    summary = family.validate(directory, frozen)
    steps = family.default_num_steps(config) if num_steps is None else num_steps
    check_int("num_steps", steps, 1, hint="tokens proposed per verify round")
    stop = _stop_tokens(frozen) if stop_token_ids is None else set(stop_token_ids)
    speculator = family.load_speculator(directory, frozen, steps)
    prompt_tensors = [as_prompt(p, frozen) for p in prompts]
    engine_info: dict[str, Any] | None = None
    if engine == "vllm":
        served = serve_with_vllm(
            family,
            directory,
            summary.architecture,
            target,
            frozen,
            prompt_tensors,
            steps,
            max_new_tokens,
            stop,
            dtype=target_dtype,
            python=vllm_python,
            progress=progress,
        )
        generations, engine_info = served.as_generations(), served.engine_info()
    else:
        generations = map_with_progress(
            lambda p: speculative_generate(frozen, speculator, p, max_new_tokens, stop),
            prompt_tensors,
            "speculative decoding",
            lambda g: len(g.tokens),
            enabled=progress,
        )
    lossless = None
    if check_lossless:
        reference = map_with_progress(
            lambda p: greedy_generate(frozen, p, max_new_tokens, stop),
            prompt_tensors,
            "target greedy decode (lossless check)",
            len,
            enabled=progress,
        )
        lossless = all(g.tokens == r for g, r in zip(generations, reference, strict=True))
    training = None
    if with_training_estimate:
        module = family.load_training_module(directory, frozen, steps)
        if module is not None:
            say(f"evaluate: the training-time estimate (tau_sim) on the same {len(prompt_tensors)} prompts")
            module.to(frozen.lm_head.weight.device).eval()
            continuations = [g.tokens for g in generations]
            training = training_estimate(module, prompt_tensors, continuations, num_steps=steps)
    return EvaluationReport(
        export_dir=str(directory),
        architecture=summary.architecture,
        num_steps=steps,
        max_new_tokens=max_new_tokens,
        num_prompts=len(prompt_tensors),
        generated_tokens=sum(len(g.tokens) for g in generations),
        rounds=sum(len(g.accepted) for g in generations),
        served=served_acceptance(generations, steps),
        training=training,
        lossless=lossless,
        export=summary,
        prompts=[p.tolist() for p in prompt_tensors],
        generations=[g.tokens for g in generations],
        engine=engine,
        engine_info=engine_info,
    )


def resolve_target(
    target: FrozenTarget | TargetSpec | None,
    config: Mapping[str, Any],
    directory: Path,
    seed: int | None = None,
    attn_backend: str = "sdpa",
    dtype: str | None = None,
    device: str | torch.device | None = None,
) -> FrozenTarget:
    """The frozen target to serve with: the one given, or the one the export records (``lightning_drafts.training.target``)."""
    if isinstance(target, FrozenTarget):
        return target if device is None else target.to(device)
    record = config.get("lightning_drafts") or {}
    spec = record.get("target") if target is None else target
    if spec is None:
        raise ValueError(
            f"{directory / CONFIG_FILE} does not record its target (lightning_drafts.training.target); pass the target "
            "(hub id / path / config dict) explicitly"
        )
    seed = record.get("target_seed", 0) if seed is None else seed
    frozen = FrozenTarget(spec, attn_backend=attn_backend, dtype=dtype, seed=seed)
    return frozen if device is None else frozen.to(device)


def _target_name(target: FrozenTarget | TargetSpec | None, config: Mapping[str, Any]) -> str:
    if isinstance(target, FrozenTarget):
        return "the target given"
    spec = (config.get("lightning_drafts") or {}).get("target") if target is None else target
    return "a config-dict target" if isinstance(spec, Mapping) else str(spec)


def _stop_tokens(target: FrozenTarget) -> set[int]:
    eos = getattr(target.text_config, "eos_token_id", None)
    ids = eos if isinstance(eos, (list, tuple)) else [eos]
    return {int(i) for i in ids if i is not None}
