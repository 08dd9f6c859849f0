"""Serving-faithful acceptance: greedy speculative decoding from an **exported** draft directory.

Training metrics can look excellent while the exported draft accepts about one token in vLLM / SGLang
(wrong captured layers, a missing LM head, ``d2t`` read differently, RoPE settings lost). This module
measures what serving would see: it validates the export, loads it through its family's loader (the files
an engine reads, not the in-memory module), drafts with it, verifies with the frozen target, and reports
the real acceptance next to the training-time estimate (tau_sim of the family's ``compute_loss``) of the
same checkpoint on the same prompts.

The decode loop is family-agnostic and deliberately simple (batch of one, no KV cache: the target re-runs
on the whole sequence each round, fine for tiny and mid-size targets). One **round**:

1. the speculator proposes ``k <= num_steps`` tokens from the verified prefix and the target's captured
   features of that prefix (what serving engines hand a draft);
2. one target forward over ``prefix + proposal`` gives the target's greedy token at every proposed
   position and one past them;
3. the longest matching prefix of the proposal is accepted, then the target's own token at the first
   mismatch (or after a fully accepted proposal) is emitted as the correction / bonus token.

So every emitted token is the target's greedy token: the output equals the target's own greedy decode
(lossless), whatever the draft does. A round's acceptance length is ``accepted + 1``; the mean over rounds
is the figure engines report.

Draft families plug in a :class:`Speculator` through a :class:`ServedFamily`, found by the export's
``architectures[0]`` in :data:`FAMILY_MODULES` (see ``lightning_drafts/eagle3/speculate.py``).
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor

from lightning_drafts.acceptance import AcceptanceStats
from lightning_drafts.base import DraftModule
from lightning_drafts.batch import validate_batch
from lightning_drafts.export_check import CONFIG_FILE, ExportSummary, architecture_of, read_export
from lightning_drafts.target import FrozenTarget, TargetSpec

# Export architecture -> module exposing ``SERVED_FAMILY``; imported only when an export names it.
FAMILY_MODULES: dict[str, str] = {
    "LlamaForCausalLMEagle3": "lightning_drafts.eagle3.speculate",
    "LightningDraftsMLAEagle3": "lightning_drafts.eagle3.speculate",
    "DFlashDraftModel": "lightning_drafts.dflash.speculate",
    "DFlash2DraftModel": "lightning_drafts.dflash.speculate",
    "DSparkDraftModel": "lightning_drafts.dspark.speculate",
    "Qwen3DSparkModel": "lightning_drafts.dspark.speculate",
}


# --- the plug-in interface ---------------------------------------------------------------------------


@dataclass(frozen=True)
class VerifiedPrefix:
    """What a speculator sees at the start of a round (one sequence, no batch dimension).

    Attributes:
        tokens: long ``[L]``, the prompt and every emitted token. The last one (the previous round's
            bonus / correction token, or the prefill's first token) is verified but has no target
            features yet: the target has not run on it.
        hidden_states: one ``[L - 1, H_t]`` tensor per id in the speculator's ``target_layer_ids``, in
            that order: the target's decoder-layer **outputs** (HF ``hidden_states[id + 1]``) at
            ``tokens[:-1]``.
        last_hidden_state: ``[L - 1, H_t]``, the target's final-norm hidden state at ``tokens[:-1]``
            (what its LM head reads).
        target: the frozen target, for drafts that reuse its embedding or LM head (e.g. DFlash).
    """

    tokens: Tensor
    hidden_states: tuple[Tensor, ...]
    last_hidden_state: Tensor
    target: FrozenTarget


@runtime_checkable
class Speculator(Protocol):
    """A draft as a serving engine runs it: propose up to ``num_steps`` target tokens per round.

    Attributes:
        num_steps: the most tokens one proposal holds (EAGLE-3: chain depth; DFlash: block size - 1).
        target_layer_ids: the target decoder-layer outputs (0-based, HF ``hidden_states[id + 1]``) the
            draft reads, read from the exported config in the convention the engine uses.
    """

    num_steps: int
    target_layer_ids: tuple[int, ...]

    def propose(self, prefix: VerifiedPrefix) -> Tensor:
        """Long ``[k]`` **target** vocabulary ids continuing ``prefix.tokens``, ``0 <= k <= num_steps``."""
        ...


@dataclass(frozen=True)
class ServedFamily:
    """How :func:`evaluate_export` reads one draft family's export.

    Attributes:
        name: a label for reports.
        validate: ``(export_dir, target or None) -> ExportSummary``; raises ``ValueError`` naming each
            defective field.
        load_speculator: ``(export_dir, target, num_steps) -> Speculator`` built from the exported files
            only (config + safetensors), on the target's device.
        load_training_module: ``(export_dir, target, num_steps) -> DraftModule`` whose ``compute_loss``
            gives the training-time estimate with ``num_steps`` positions per chain, or ``None`` when the
            export does not record how to rebuild it.
        default_num_steps: ``config.json -> int``, the proposal length when none is asked for.
    """

    name: str
    validate: Callable[[Path, FrozenTarget | None], ExportSummary]
    load_speculator: Callable[[Path, FrozenTarget, int], Speculator]
    load_training_module: Callable[[Path, FrozenTarget, int], DraftModule | None]
    default_num_steps: Callable[[dict[str, Any]], int]


def served_family(architecture: str) -> ServedFamily:
    """The :class:`ServedFamily` registered for an export's ``architectures[0]``."""
    module_name = FAMILY_MODULES.get(architecture)
    if module_name is None:
        raise ValueError(
            f"no speculator is registered for architecture {architecture!r} (known: {sorted(FAMILY_MODULES)}); "
            "add the family's speculate module to lightning_drafts.evaluate.FAMILY_MODULES"
        )
    return importlib.import_module(module_name).SERVED_FAMILY


def validate_export(directory: str | Path, target: FrozenTarget | None = None) -> ExportSummary:
    """Run the family validator of the export in ``directory`` (``ValueError`` on any defect)."""
    directory = Path(directory)
    architecture = architecture_of(read_export(directory).config, directory)
    return served_family(architecture).validate(directory, target)


# --- the decode loop ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Generation:
    """One prompt's greedy continuation and, for speculative decoding, what each round accepted.

    ``accepted[r]`` counts the draft tokens round ``r`` accepted (before cutting the output at
    ``max_new_tokens`` or a stop token); ``proposed[r]`` is the length of that round's proposal.
    """

    tokens: list[int]
    accepted: list[int] = field(default_factory=list)
    proposed: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class _TargetPass:
    greedy: Tensor
    hidden_states: tuple[Tensor, ...]
    last_hidden_state: Tensor


def _run_target(target: FrozenTarget, tokens: Tensor, layer_ids: Sequence[int]) -> _TargetPass:
    packed = validate_batch({"input_ids": tokens[None]}, vocab_size=target.vocab_size)
    output = target(packed, layer_ids)
    last = output.last_hidden_state
    return _TargetPass(target.greedy_tokens(last)[0], tuple(h[0] for h in output.hidden_states), last[0])


@torch.no_grad()
def greedy_generate(
    target: FrozenTarget, prompt: Tensor, max_new_tokens: int, stop_token_ids: Iterable[int] = ()
) -> list[int]:
    """The target's own greedy continuation of ``prompt`` (the reference a lossless decode must equal)."""
    stop = set(stop_token_ids)
    tokens = _as_prompt(prompt, target)
    generated: list[int] = []
    while len(generated) < max_new_tokens:
        token = int(_run_target(target, tokens, ()).greedy[-1])
        generated.append(token)
        tokens = torch.cat([tokens, tokens.new_tensor([token])])
        if token in stop:
            break
    return generated


@torch.no_grad()
def speculative_generate(
    target: FrozenTarget,
    speculator: Speculator,
    prompt: Tensor,
    max_new_tokens: int,
    stop_token_ids: Iterable[int] = (),
) -> Generation:
    """Greedy speculative decoding of ``prompt``: lossless by construction (see the module docstring)."""
    stop = set(stop_token_ids)
    layer_ids = tuple(speculator.target_layer_ids)
    tokens = _as_prompt(prompt, target)
    prefill = _run_target(target, tokens, layer_ids)
    first = int(prefill.greedy[-1])
    generated, accepted, proposed = [first], [], []
    features, last_hidden = prefill.hidden_states, prefill.last_hidden_state
    tokens = torch.cat([tokens, tokens.new_tensor([first])])
    while len(generated) < max_new_tokens and not stop.intersection(generated):
        prefix = VerifiedPrefix(tokens, features, last_hidden, target)
        proposal = _checked_proposal(speculator, speculator.propose(prefix), target.vocab_size, tokens.device)
        verified = _run_target(target, torch.cat([tokens, proposal]), layer_ids)
        # verified.greedy[L - 1 + j] is the target's token at position L + j, i.e. its check of proposal[j].
        check = verified.greedy[tokens.numel() - 1 :]
        matches = (proposal == check[: proposal.numel()]).long().cumprod(0)
        count = int(matches.sum())
        emitted = torch.cat([proposal[:count], check[count : count + 1]])
        accepted.append(count)
        proposed.append(int(proposal.numel()))
        generated.extend(int(t) for t in emitted)
        tokens = torch.cat([tokens, emitted])
        # Causal attention: the features of the accepted tokens from this pass are those of the new prefix.
        keep = tokens.numel() - 1
        features = tuple(h[:keep] for h in verified.hidden_states)
        last_hidden = verified.last_hidden_state[:keep]
    return Generation(_cut(generated, max_new_tokens, stop), accepted, proposed)


def _as_prompt(prompt: Tensor | Sequence[int], target: FrozenTarget) -> Tensor:
    device = target.lm_head.weight.device
    tokens = torch.as_tensor(prompt, dtype=torch.long, device=device).reshape(-1)
    if tokens.numel() == 0:
        raise ValueError("a prompt is empty; speculative decoding needs at least one prompt token")
    return tokens


def _checked_proposal(speculator: Speculator, proposal: Any, vocab_size: int, device: torch.device) -> Tensor:
    name = type(speculator).__name__
    if not isinstance(proposal, Tensor) or proposal.dim() != 1 or proposal.dtype != torch.long:
        got = tuple(proposal.shape) if isinstance(proposal, Tensor) else type(proposal).__name__
        raise ValueError(f"{name}.propose must return a 1-D long tensor of target ids, got {got}")
    if proposal.numel() > speculator.num_steps:
        raise ValueError(
            f"{name}.propose returned {proposal.numel()} tokens, more than num_steps={speculator.num_steps}"
        )
    if proposal.numel() and (int(proposal.min()) < 0 or int(proposal.max()) >= vocab_size):
        raise ValueError(
            f"{name}.propose returned ids outside the target vocabulary [0, {vocab_size}): {proposal.tolist()}; "
            "map draft ids to target ids (target = draft + d2t[draft]) before returning"
        )
    return proposal.to(device)


def _cut(generated: list[int], max_new_tokens: int, stop: set[int]) -> list[int]:
    generated = generated[:max_new_tokens]
    for index, token in enumerate(generated):
        if token in stop:
            return generated[: index + 1]
    return generated


# --- acceptance accounting ----------------------------------------------------------------------------


@dataclass(frozen=True)
class AcceptanceSummary:
    """Acceptance in prefix form, comparable between served decoding and the training estimate.

    Attributes:
        accept_len: ``1 + sum_k hits[k] / denominator[k]`` (served: the mean of ``accepted + 1`` over
            rounds; training: tau_sim). ``None`` when there was nothing to count.
        hits: per position ``k``, chains / rounds whose first ``k + 1`` drafted tokens were all accepted.
        denominators: served: the number of rounds at every position; training: chains valid up to ``k``.
        prefix_rate: ``hits[k] / denominators[k]``.
        position_accuracy: served: accepted at ``k`` given everything before was (``hits[k] /
            hits[k - 1]``); training: ``acc_pos{k}``, accuracy at ``k`` with a ground-truth prefix.
    """

    accept_len: float | None
    hits: list[int]
    denominators: list[int]
    prefix_rate: list[float]
    position_accuracy: list[float]


def served_acceptance(generations: Sequence[Generation], num_steps: int) -> AcceptanceSummary:
    """Prefix acceptance over every round of ``generations``."""
    accepted = torch.tensor([a for g in generations for a in g.accepted], dtype=torch.long)
    rounds = int(accepted.numel())
    hits = [int((accepted > k).sum()) for k in range(num_steps)]
    reached = [rounds] + hits[:-1]
    return AcceptanceSummary(
        accept_len=float(accepted.double().mean() + 1) if rounds else None,
        hits=hits,
        denominators=[rounds] * num_steps,
        prefix_rate=[h / rounds if rounds else 0.0 for h in hits],
        position_accuracy=[h / r if r else 0.0 for h, r in zip(hits, reached, strict=True)],
    )


@torch.no_grad()
def training_estimate(
    module: DraftModule,
    prompts: Sequence[Tensor],
    continuations: Sequence[Sequence[int]],
    batch_size: int = 8,
) -> AcceptanceSummary:
    """tau_sim of ``module.compute_loss`` on ``prompt + continuation`` documents.

    The continuation (the target's greedy output) is the supervised span, as an assistant answer is in
    training, so the estimate covers exactly the tokens the served decode produced.
    """
    documents = [
        (prompt.detach().cpu().long(), torch.as_tensor(list(cont), dtype=torch.long))
        for prompt, cont in zip(prompts, continuations, strict=True)
        if len(cont)
    ]
    stats: AcceptanceStats | None = None
    device = next(module.parameters()).device
    for start in range(0, len(documents), batch_size):
        batch = _supervised_rows(documents[start : start + batch_size])
        output = module.compute_loss({key: value.to(device) for key, value in batch.items()})
        if stats is None:
            stats = AcceptanceStats(output.correct.shape[1]).to(device)
        stats.update(output.correct, output.valid, output.valid_tokens)
    if stats is None or int(stats.chain_valid.sum()) == 0:
        return AcceptanceSummary(None, [], [], [], [])
    hits, valid = stats.hits.tolist(), stats.chain_valid.tolist()
    computed = stats.compute()
    return AcceptanceSummary(
        accept_len=float(computed["accept_len"]),
        hits=hits,
        denominators=valid,
        prefix_rate=[h / v if v else 0.0 for h, v in zip(hits, valid, strict=True)],
        position_accuracy=[float(computed[f"acc_pos{k}"]) for k in range(len(hits))],
    )


def _supervised_rows(documents: Sequence[tuple[Tensor, Tensor]]) -> dict[str, Tensor]:
    """One right-padded row per document; ``loss_mask`` marks the continuation."""
    width = max(p.numel() + c.numel() for p, c in documents)
    ids = torch.zeros(len(documents), width, dtype=torch.long)
    attention = torch.zeros_like(ids)
    loss = torch.zeros_like(ids)
    for row, (prompt, continuation) in enumerate(documents):
        length = prompt.numel() + continuation.numel()
        ids[row, :length] = torch.cat([prompt, continuation])
        attention[row, :length] = 1
        loss[row, prompt.numel() : length] = 1
    return {"input_ids": ids, "attention_mask": attention, "loss_mask": loss}


# --- the report ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class EvaluationReport:
    """Served acceptance beside the training-time estimate for one export on one prompt set."""

    export_dir: str
    architecture: str
    num_steps: int
    max_new_tokens: int
    num_prompts: int
    generated_tokens: int
    rounds: int
    served: AcceptanceSummary
    training: AcceptanceSummary | None
    lossless: bool | None
    export: ExportSummary
    prompts: list[list[int]]
    generations: list[list[int]]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def write_json(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        return path

    def format_table(self) -> str:
        """A small text table: served acceptance and tau_sim side by side, then per drafted position."""
        training = self.training
        lines = [
            f"{self.export_dir} ({self.architecture}): {self.num_prompts} prompts, {self.generated_tokens} tokens, "
            f"{self.rounds} verify rounds, num_steps={self.num_steps}, layers {list(self.export.target_layer_ids)}",
            f"{'':22}{'served':>10}{'tau_sim (training)':>22}",
            f"{'accept_len':22}{_number(self.served.accept_len):>10}"
            f"{_number(training.accept_len if training else None):>22}",
        ]
        for k in range(self.num_steps):
            train_rate = _at(training.prefix_rate, k) if training else None
            train_acc = _at(training.position_accuracy, k) if training else None
            served_rate, served_acc = self.served.prefix_rate[k], self.served.position_accuracy[k]
            lines.append(
                f"{f'pos {k + 1} prefix rate':22}{_number(served_rate):>10}{_number(train_rate):>22}"
            )
            lines.append(f"{f'pos {k + 1} accuracy':22}{_number(served_acc):>10}{_number(train_acc):>22}")
        lines.append(
            "prefix rate: share of rounds (chains) whose first k drafted tokens were all accepted; accuracy: "
            "served = accepted given the earlier ones were, training = acc_pos{k} after a ground-truth prefix"
        )
        if self.lossless is not None:
            verdict = (
                "yes, equal to the target's greedy output"
                if self.lossless
                else "NO, differs from target greedy"
            )
            lines.append(f"lossless: {verdict}")
        return "\n".join(lines)


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _at(values: Sequence[float], index: int) -> float | None:
    return values[index] if index < len(values) else None


# --- evaluating an export -----------------------------------------------------------------------------


def evaluate_export(
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
) -> EvaluationReport:
    """Validate, load and serve the export in ``export_dir`` on ``prompts``; report served vs training acceptance.

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
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 1")
    if not prompts:
        raise ValueError("no prompts to evaluate on; pass at least one token-id prompt")
    directory = Path(export_dir)
    config = read_export(directory).config
    family = served_family(architecture_of(config, directory))
    frozen = resolve_target(target, config, directory, target_seed, target_attn_backend, target_dtype, device)
    summary = family.validate(directory, frozen)
    steps = family.default_num_steps(config) if num_steps is None else num_steps
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"num_steps={steps!r} must be an int >= 1 (tokens proposed per verify round)")
    stop = _stop_tokens(frozen) if stop_token_ids is None else set(stop_token_ids)
    speculator = family.load_speculator(directory, frozen, steps)
    prompt_tensors = [_as_prompt(p, frozen) for p in prompts]
    generations = [speculative_generate(frozen, speculator, p, max_new_tokens, stop) for p in prompt_tensors]
    lossless = None
    if check_lossless:
        lossless = all(
            g.tokens == greedy_generate(frozen, p, max_new_tokens, stop)
            for p, g in zip(prompt_tensors, generations, strict=True)
        )
    training = None
    if with_training_estimate:
        module = family.load_training_module(directory, frozen, steps)
        if module is not None:
            module.to(frozen.lm_head.weight.device).eval()
            training = training_estimate(module, prompt_tensors, [g.tokens for g in generations])
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
    """The frozen target to serve with: the one given, or the one the export records (``lightning_drafts.target``)."""
    if isinstance(target, FrozenTarget):
        return target if device is None else target.to(device)
    record = config.get("lightning_drafts") or {}
    spec = record.get("target") if target is None else target
    if spec is None:
        raise ValueError(
            f"{directory / CONFIG_FILE} does not record its target (lightning_drafts.target); pass the target "
            "(hub id / path / config dict) explicitly"
        )
    seed = record.get("target_seed", 0) if seed is None else seed
    frozen = FrozenTarget(spec, attn_backend=attn_backend, dtype=dtype, seed=seed)
    return frozen if device is None else frozen.to(device)


def _stop_tokens(target: FrozenTarget) -> set[int]:
    eos = getattr(target.text_config, "eos_token_id", None)
    ids = eos if isinstance(eos, (list, tuple)) else [eos]
    return {int(i) for i in ids if i is not None}


# --- prompts ------------------------------------------------------------------------------------------


def prompt_of_document(
    input_ids: Tensor, loss_mask: Tensor, max_prompt_tokens: int | None = None
) -> Tensor | None:
    """The tokens before a document's first supervised (assistant) token, or ``None`` if there are none.

    ``max_prompt_tokens`` keeps the last tokens of a long prompt (the ones next to the answer).
    """
    supervised = torch.as_tensor(loss_mask).reshape(-1).bool().nonzero()
    if supervised.numel() == 0 or int(supervised[0]) == 0:
        return None
    prompt = torch.as_tensor(input_ids).reshape(-1)[: int(supervised[0])].long()
    return prompt if max_prompt_tokens is None else prompt[-max_prompt_tokens:]


def prompts_from_batch(
    batch: Mapping[str, Tensor], limit: int, max_prompt_tokens: int | None = None
) -> list[Tensor]:
    """Up to ``limit`` prompts from a (packed or padded) contract batch, one per document with an answer."""
    packed = validate_batch(batch)
    prompts: list[Tensor] = []
    for row in range(packed.shape[0]):
        real = packed.attention_mask[row]
        for doc in packed.doc_ids[row][real].unique().tolist():
            in_doc = (packed.doc_ids[row] == doc) & real
            prompt = prompt_of_document(
                packed.input_ids[row][in_doc], packed.loss_mask[row][in_doc], max_prompt_tokens
            )
            if prompt is not None:
                prompts.append(prompt.cpu())
            if len(prompts) >= limit:
                return prompts
    return prompts


def load_prompts_jsonl(path: str | Path, limit: int | None = None) -> list[Tensor]:
    """Token-id prompts, one JSON line each: a list of ids or an object with ``prompt_ids`` / ``input_ids``.

    An object with ``input_ids`` and ``loss_mask`` gives the tokens before its first supervised token.
    """
    prompts: list[Tensor] = []
    for number, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        row = json.loads(line)
        if isinstance(row, dict) and "loss_mask" in row and "input_ids" in row:
            prompt = prompt_of_document(torch.tensor(row["input_ids"]), torch.tensor(row["loss_mask"]))
        elif isinstance(row, dict):
            prompt = row.get("prompt_ids", row.get("input_ids"))
        else:
            prompt = row
        if prompt is None or not isinstance(prompt, (list, Tensor)) or len(prompt) == 0:
            raise ValueError(
                f"{path}:{number} is not a prompt: write a JSON list of token ids, or an object with 'prompt_ids' "
                "(or 'input_ids' with a 'loss_mask' that marks the answer)"
            )
        prompts.append(torch.as_tensor(prompt, dtype=torch.long))
        if limit is not None and len(prompts) >= limit:
            break
    return prompts


def prompts_from_datamodule(
    datamodule: Any, limit: int, max_prompt_tokens: int | None = None
) -> list[Tensor]:
    """Held-out prompts of a ``datamodules.PackedChatDataModule`` (its validation documents).

    Falls back to the training documents, with a warning, when the data module holds out nothing.
    """
    datamodule.setup("validate")
    documents = datamodule.val_documents
    if documents is None or len(documents) == 0:
        import warnings

        warnings.warn(
            "the data module holds out no validation documents (set val_fraction or val_data_files); "
            "evaluating on training prompts",
            stacklevel=2,
        )
        documents = datamodule.train_documents
    prompts: list[Tensor] = []
    for index in range(len(documents)):
        ids, mask = documents.tokens(index)
        prompt = prompt_of_document(torch.tensor(ids), torch.tensor(mask), max_prompt_tokens)
        if prompt is not None:
            prompts.append(prompt)
        if len(prompts) >= limit:
            break
    return prompts
