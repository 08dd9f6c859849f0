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

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from lightning_drafts.core.checks import check_int
from lightning_drafts.serving.conversation_prompts import turn_prompt
from lightning_drafts.serving.decode import Generation, as_prompt, greedy_generate, speculative_generate
from lightning_drafts.serving.draft_tree import TreeShape
from lightning_drafts.serving.export_files import CONFIG_FILE, read_export
from lightning_drafts.serving.family import DraftFamily, Speculator
from lightning_drafts.serving.other_target import naming_both_targets
from lightning_drafts.serving.progress import announce, map_with_progress
from lightning_drafts.serving.prompt_limits import check_positions, cut_prompts, report_cut_prompts
from lightning_drafts.serving.prompt_sets import Conversation
from lightning_drafts.serving.report import EvaluationReport, served_acceptance, training_estimate
from lightning_drafts.serving.sampling import Sampling
from lightning_drafts.serving.served_table import ServedRequest, served_rows
from lightning_drafts.serving.vllm_evaluate import serve_with_vllm
from lightning_drafts.training.target import FrozenTarget, TargetSpec

ENGINES = ("builtin", "vllm")
TOKEN_PROMPTS = "prompts"


@dataclass(frozen=True)
class _Phase:
    """One turn of every request that has it, served: the speculative generations, the output tokens of
    each speed mode, and each mode's decode seconds per (prompt set, category) group."""

    generations: list[Generation]
    outputs: dict[str, list[list[int]]]
    seconds: dict[str, dict[tuple[str, str], float]]
    engine_info: dict[str, Any] | None = None


def evaluate_family_export(
    family: DraftFamily,
    export_dir: str | Path,
    prompts: Sequence[Tensor | Sequence[int]] | Sequence[Conversation],
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
    tokenizer: Any = None,
    baseline: bool = False,
    ngram: bool = False,
    max_prompt_tokens: int | None = None,
    sampling: Sampling | None = None,
    seed: int = 0,
    topk: int | None = None,
    num_draft_tokens: int | None = None,
) -> EvaluationReport:
    """Validate, load and serve ``family``'s export in ``export_dir`` on ``prompts``; report served vs
    training acceptance.

    Args:
        prompts: token-id prompts (1-D tensors or lists), in the target's vocabulary, or conversations of a
            prompt set (:mod:`lightning_drafts.serving.prompt_sets`), rendered with ``tokenizer``'s chat
            template; turn ``k > 1`` is asked after the target's own greedy answer to turn ``k - 1``.
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
        tokenizer: renders conversations (a transformers tokenizer with a chat template).
        baseline: also decode every prompt with the target alone in the same engine, for tokens/s without
            speculation (always done for conversations of several turns: their later turns need the
            target's own answers).
        ngram: with ``engine="vllm"``, also serve the prompts with vLLM's n-gram speculator.
        max_prompt_tokens: keep the last tokens of each prompt (token ids or a rendered conversation
            turn); how many prompts were cut is logged as a warning. A prompt whose decode would pass the
            target's ``max_position_embeddings`` is refused before any decode.
        sampling: sample (temperature, top-p) instead of greedy decoding, with speculative sampling's
            acceptance rule (:mod:`lightning_drafts.serving.sampling`; vLLM's rejection sampler with
            ``engine="vllm"``). Request ``i`` of a turn draws from a generator seeded ``seed + i`` (with the
            draft and without alike; vLLM's per-request generator there, so the two engines draw different
            numbers and agree in distribution).
        topk, num_draft_tokens: draft SGLang's token trees (``--speculative-eagle-topk``,
            ``--speculative-num-draft-tokens``; ``num_steps`` is their depth), verified in the built-in
            engine (:mod:`lightning_drafts.serving.draft_tree`), greedy or sampled; both or neither.
    """
    if engine not in ENGINES:
        raise ValueError(f"engine={engine!r} is unknown; choose one of {ENGINES}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 1")
    if not prompts:
        raise ValueError("no prompts to evaluate on; pass at least one token-id prompt")
    if sampling is not None and check_lossless:
        raise ValueError(
            "a sampled decode matches the target's distribution, not its tokens: drop check_lossless or the "
            "sampling"
        )
    trees = topk is not None or num_draft_tokens is not None
    if trees and (topk is None or num_draft_tokens is None):
        raise ValueError(
            f"topk={topk}, num_draft_tokens={num_draft_tokens}: tree drafting needs both (SGLang's "
            "--speculative-eagle-topk and --speculative-num-draft-tokens)"
        )
    if trees and engine != "builtin":
        raise ValueError(
            "tree drafting (topk, num_draft_tokens) runs in the built-in engine only (vLLM 0.32's CPU build "
            "drafts chains); drop engine='vllm' or the tree settings"
        )
    if ngram and engine != "vllm":
        raise ValueError("ngram=True measures vLLM's n-gram speculator: it needs engine='vllm'")
    conversations = [p for p in prompts if isinstance(p, Conversation)]
    if conversations and len(conversations) != len(prompts):
        raise ValueError("prompts mix conversations and token-id prompts; pass one kind")
    if conversations and tokenizer is None:
        raise ValueError("conversation prompts are text: pass the target's tokenizer to render them")
    directory = Path(export_dir)
    say = announce if progress else (lambda message: None)
    config = read_export(directory).config
    steps = family.default_num_steps(config) if num_steps is None else num_steps
    check_int("num_steps", steps, 1, hint="tokens proposed per verify round")
    tree = None if topk is None or num_draft_tokens is None else TreeShape(steps, topk, num_draft_tokens)
    say(f"evaluate: loading the target ({_target_name(target, config)})")
    frozen = resolve_target(target, config, directory, target_seed, target_attn_backend, target_dtype, device)
    say(f"evaluate: validating the export {directory}")
    try:
        summary = family.validate(directory, frozen)
    except ValueError as error:
        recorded = (config.get("lightning_drafts") or {}).get("target")
        if target is None or recorded is None or target == recorded:
            raise
        raise naming_both_targets(directory, recorded, target, error) from error
    stop = _stop_tokens(frozen) if stop_token_ids is None else set(stop_token_ids)
    speculator = family.load_speculator(directory, frozen, steps)
    baseline = baseline or any(len(c.turns) > 1 for c in conversations)

    def serve(phase_prompts: list[Tensor], phase_requests: list[ServedRequest]) -> _Phase:
        if engine == "vllm":
            return _serve_vllm(
                family,
                directory,
                summary.architecture,
                target,
                frozen,
                phase_prompts,
                phase_requests,
                steps,
                max_new_tokens,
                stop,
                target_dtype,
                vllm_python,
                progress,
                baseline,
                ngram,
                sampling,
                seed,
            )
        return _serve_builtin(
            frozen,
            speculator,
            phase_prompts,
            phase_requests,
            max_new_tokens,
            stop,
            baseline,
            progress,
            sampling,
            seed,
            tree,
        )

    max_positions = getattr(frozen.text_config, "max_position_embeddings", None)
    requests: list[ServedRequest] = []
    prompt_tensors: list[Tensor] = []
    prompts_cut = 0
    phases: list[_Phase] = []
    if conversations:
        answers: list[list[list[int]]] = [[] for _ in conversations]
        for turn in range(max(len(c.turns) for c in conversations)):
            asked = [i for i, c in enumerate(conversations) if len(c.turns) > turn]
            say(f"evaluate: turn {turn + 1} of {len(asked)} conversations")
            phase_requests = [_request(conversations[i], turn) for i in asked]
            phase_prompts, cut = cut_prompts(
                [
                    as_prompt(turn_prompt(tokenizer, conversations[i], answers[i], stop), frozen)
                    for i in asked
                ],
                max_prompt_tokens,
            )
            prompts_cut += cut
            check_positions(phase_prompts, max_new_tokens, steps, max_positions)
            phase = serve(phase_prompts, phase_requests)
            for i, own in zip(asked, phase.outputs.get("target", phase.outputs["draft"]), strict=True):
                answers[i].append(own)  # the target's own answer, asked about in the next turn
            requests += phase_requests
            prompt_tensors += phase_prompts
            phases.append(phase)
        report_cut_prompts(prompts_cut, len(prompt_tensors), max_prompt_tokens)
    else:
        requests = [ServedRequest(TOKEN_PROMPTS, "all", str(i), 1) for i in range(len(prompts))]
        prompt_tensors, prompts_cut = cut_prompts([as_prompt(p, frozen) for p in prompts], max_prompt_tokens)
        check_positions(prompt_tensors, max_new_tokens, steps, max_positions)
        report_cut_prompts(prompts_cut, len(prompt_tensors), max_prompt_tokens)
        phases.append(serve(prompt_tensors, requests))
    generations = [g for phase in phases for g in phase.generations]
    outputs = {mode: [o for phase in phases for o in phase.outputs[mode]] for mode in phases[0].outputs}
    seconds: dict[str, dict[tuple[str, str], float]] = {}
    for phase in phases:
        for mode, groups in phase.seconds.items():
            for key, spent in groups.items():
                seconds.setdefault(mode, {}).setdefault(key, 0.0)
                seconds[mode][key] += spent
    lossless = None
    if check_lossless:
        if engine == "builtin" and "target" in outputs:
            reference = outputs["target"]
        else:
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
    engine_info = phases[-1].engine_info
    if engine_info is not None and len(phases) > 1:
        engine_info = {**engine_info, "turns": [p.engine_info for p in phases]}
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
        requests=requests,
        accepted=[list(g.accepted) for g in generations],
        table=served_rows(
            requests,
            [g.accepted for g in generations],
            {mode: [len(o) for o in made] for mode, made in outputs.items()},
            seconds,
            steps,
        ),
        speed_engine=_speed_engine(engine, engine_info, frozen),
        sampling=sampling,
        tree=tree,
        proposed=[list(g.proposed) for g in generations],
    )


def _request(conversation: Conversation, turn: int) -> ServedRequest:
    return ServedRequest(conversation.prompt_set, conversation.category, conversation.question_id, turn + 1)


def _serve_builtin(
    frozen: FrozenTarget,
    speculator: Speculator,
    prompts: list[Tensor],
    requests: list[ServedRequest],
    max_new_tokens: int,
    stop: set[int],
    baseline: bool,
    progress: bool,
    sampling: Sampling | None = None,
    seed: int = 0,
    tree: TreeShape | None = None,
) -> _Phase:
    """Each prompt decoded speculatively (and, with ``baseline``, by the target alone), one at a time, timed;
    with ``sampling``, prompt ``i`` draws from a generator seeded ``seed + i``."""
    seconds: dict[str, dict[tuple[str, str], float]] = {"draft": {}}
    device = frozen.lm_head.weight.device

    def timed(mode: str, index: int, decode: Callable[[Tensor, torch.Generator | None], Any]) -> Any:
        generator = None if sampling is None else torch.Generator(device).manual_seed(seed + index)
        start = time.perf_counter()
        result = decode(prompts[index], generator)
        spent = seconds.setdefault(mode, {})
        spent[requests[index].group] = spent.get(requests[index].group, 0.0) + time.perf_counter() - start
        return result

    generations = map_with_progress(
        lambda i: timed(
            "draft",
            i,
            lambda p, g: speculative_generate(frozen, speculator, p, max_new_tokens, stop, sampling, g, tree),
        ),
        range(len(prompts)),
        "speculative decoding",
        lambda g: len(g.tokens),
        enabled=progress,
    )
    outputs = {"draft": [g.tokens for g in generations]}
    if baseline:
        outputs["target"] = map_with_progress(
            lambda i: timed(
                "target", i, lambda p, g: greedy_generate(frozen, p, max_new_tokens, stop, sampling, g)
            ),
            range(len(prompts)),
            "target alone (no speculation)",
            len,
            enabled=progress,
        )
    return _Phase(generations, outputs, seconds)


def _serve_vllm(
    family: DraftFamily,
    directory: Path,
    architecture: str,
    target: FrozenTarget | TargetSpec | None,
    frozen: FrozenTarget,
    prompts: list[Tensor],
    requests: list[ServedRequest],
    steps: int,
    max_new_tokens: int,
    stop: set[int],
    dtype: str | None,
    python: str | Path | None,
    progress: bool,
    baseline: bool,
    ngram: bool,
    sampling: Sampling | None,
    seed: int,
) -> _Phase:
    """One vLLM engine per mode (the export drafting; the target alone; the n-gram speculator), one after
    another in one vLLM process, each generating the prompts of one (prompt set, category) group at a
    time, timed per group."""
    keys = list(dict.fromkeys(r.group for r in requests))
    groups = [[i for i, r in enumerate(requests) if r.group == key] for key in keys]
    modes = ["draft"] + (["target"] if baseline else []) + (["ngram"] if ngram else [])
    results = serve_with_vllm(
        family,
        directory,
        architecture,
        target,
        frozen,
        prompts,
        steps,
        max_new_tokens,
        stop,
        dtype=dtype,
        python=python,
        progress=progress,
        modes=modes,
        groups=groups,
        sampling=sampling,
        seed=seed,
    )
    seconds = {mode: dict(zip(keys, r.seconds["groups"], strict=True)) for mode, r in results.items()}
    info = results["draft"].engine_info()
    if "ngram" in results:
        ngram_rounds = results["ngram"].as_generations()
        info["ngram"] = {
            "rounds": results["ngram"].rounds,
            "accept_len_pooled": served_acceptance(ngram_rounds, steps).accept_len,
            "seconds": results["ngram"].seconds,
        }
    if "target" in results:
        info["target_seconds"] = results["target"].seconds
    return _Phase(
        results["draft"].as_generations(),
        {mode: r.generations for mode, r in results.items()},
        seconds,
        info,
    )


def _speed_engine(engine: str, engine_info: Mapping[str, Any] | None, frozen: FrozenTarget) -> str:
    if engine == "vllm":
        return f"vLLM {(engine_info or {}).get('vllm_version', '?')}"
    device = frozen.lm_head.weight.device
    where = "CPU" if device.type == "cpu" else str(device)
    return f"the built-in decode on {where} (batch of one, no KV cache)"


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
