"""Acceptance accounting and the evaluation report: served acceptance (from decode rounds) beside the
training-time estimate (tau_sim of the family's ``compute_loss``) on the same prompts."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from lightning_drafts.core.acceptance import AcceptanceStats
from lightning_drafts.serving.decode import Generation
from lightning_drafts.serving.draft_tree import TreeShape
from lightning_drafts.serving.export_files import ExportSummary
from lightning_drafts.serving.sampling import Sampling
from lightning_drafts.serving.served_table import (
    PER_REQUEST,
    POOLED,
    ServedRequest,
    ServedRow,
    acceptance_lengths,
    markdown_table,
)
from lightning_drafts.training.module import DraftModule


@dataclass(frozen=True)
class AcceptanceSummary:
    """Acceptance in prefix form, comparable between served decoding and the training estimate.

    Attributes:
        accept_len: ``1 + sum_k hits[k] / denominator[k]`` (served: the mean of ``accepted + 1`` over
            rounds, i.e. pooled over tokens as vLLM and SGLang report it; training: tau_sim). ``None`` when
            there was nothing to count.
        hits: per position ``k``, chains / rounds whose first ``k + 1`` drafted tokens were all accepted.
        denominators: served: the number of rounds at every position; training: chains valid up to ``k``.
        prefix_rate: ``hits[k] / denominators[k]``.
        position_accuracy: served: accepted at ``k`` given everything before was (``hits[k] /
            hits[k - 1]``); training: ``acc_pos{k}``, accuracy at ``k`` with a ground-truth prefix.
        accept_len_per_request: served only: the mean over requests of each request's own acceptance
            length (SpecForge's definition; :mod:`lightning_drafts.serving.served_table`).
    """

    accept_len: float | None
    hits: list[int]
    denominators: list[int]
    prefix_rate: list[float]
    position_accuracy: list[float]
    accept_len_per_request: float | None = None


def served_acceptance(generations: Sequence[Generation], num_steps: int) -> AcceptanceSummary:
    """Prefix acceptance over every round of ``generations`` (one generation per request)."""
    accepted = torch.tensor([a for g in generations for a in g.accepted], dtype=torch.long)
    rounds = int(accepted.numel())
    hits = [int((accepted > k).sum()) for k in range(num_steps)]
    reached = [rounds] + hits[:-1]
    pooled, per_request = acceptance_lengths([g.accepted for g in generations])
    return AcceptanceSummary(
        accept_len=pooled,
        hits=hits,
        denominators=[rounds] * num_steps,
        prefix_rate=[h / rounds if rounds else 0.0 for h in hits],
        position_accuracy=[h / r if r else 0.0 for h, r in zip(hits, reached, strict=True)],
        accept_len_per_request=per_request,
    )


@torch.no_grad()
def training_estimate(
    module: DraftModule,
    prompts: Sequence[Tensor],
    continuations: Sequence[Sequence[int]],
    batch_size: int = 8,
    num_steps: int | None = None,
) -> AcceptanceSummary:
    """tau_sim of ``module.compute_loss`` on ``prompt + continuation`` documents.

    The continuation (the target's greedy output) is the supervised span, as an assistant answer is in
    training, so the estimate covers exactly the tokens the served decode produced. ``num_steps`` keeps
    the first positions of every chain, the ones a round proposes (a block draft's chains cover its whole
    block, over the same blocks).
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
        correct, valid = output.correct[:, :num_steps], output.valid[:, :num_steps]
        # Cut chains count the predictions they keep.
        tokens = output.valid_tokens if correct.shape == output.correct.shape else None
        if stats is None:
            stats = AcceptanceStats(correct.shape[1]).to(device)
        stats.update(correct, valid, tokens)
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
    """Served acceptance beside the training-time estimate for one export on one prompt set.

    ``engine`` is what served it: ``"builtin"`` (the project's decode) or ``"vllm"``, whose version, own
    counters (``rounds``, ``accepted_per_position``) and timings are in ``engine_info``. ``requests`` says
    which prompt set, category, question and turn each prompt is, ``accepted`` the drafted tokens each of
    its verify rounds accepted; ``table`` holds the results per prompt set and category (both acceptance
    lengths, tokens/s measured in ``speed_engine``).
    """

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
    engine: str = "builtin"
    engine_info: dict[str, Any] | None = None
    requests: list[ServedRequest] = field(default_factory=list)
    accepted: list[list[int]] = field(default_factory=list)
    table: list[ServedRow] = field(default_factory=list)
    speed_engine: str = "the built-in decode"
    sampling: Sampling | None = None
    tree: TreeShape | None = None
    proposed: list[list[int]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def write_json(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        return path

    def markdown(self) -> str:
        """The results per prompt set and category as a Markdown table."""
        return markdown_table(self.table, self.speed_engine)

    def write_results(self, directory: str | Path) -> tuple[Path, Path]:
        """``served.json`` (the whole report) and ``served.md`` (the table) in ``directory``."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        markdown = directory / "served.md"
        markdown.write_text(
            f"# Served results: {self.export_dir} ({self.architecture}), served by {self._engine_name()}, "
            f"{self.decoding()}, "
            f"num_steps={self.num_steps}, max_new_tokens={self.max_new_tokens}\n\n{self.markdown()}\n"
        )
        return self.write_json(directory / "served.json"), markdown

    def format_table(self) -> str:
        """A small text table: served acceptance and tau_sim side by side, then per drafted position."""
        training = self.training
        lines = [
            f"{self.export_dir} ({self.architecture}): {self.num_prompts} prompts, {self.generated_tokens} tokens, "
            f"{self.rounds} verify rounds, num_steps={self.num_steps}, layers {list(self.export.target_layer_ids)}, "
            f"served by {self._engine_name()}, {self.decoding()}",
            f"{'':22}{'served':>10}{'tau_sim (training)':>22}",
            f"{'accept_len pooled':22}{_number(self.served.accept_len):>10}"
            f"{_number(training.accept_len if training else None):>22}",
            f"{'accept_len per-request':22}{_number(self.served.accept_len_per_request):>10}{'-':>22}",
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
        lines += ["", self.markdown()] if self.table else [f"{POOLED}; {PER_REQUEST}"]
        if self.lossless is not None:
            verdict = (
                "yes, equal to the target's greedy output"
                if self.lossless
                else "NO, differs from target greedy"
            )
            lines.append(f"lossless: {verdict}")
        return "\n".join(lines)

    def decoding(self) -> str:
        """Greedy or the sampling settings, then the tree settings if trees were drafted."""
        if self.sampling is None:
            decoding = "greedy"
        else:
            decoding = f"sampled at temperature {self.sampling.temperature}, top_p {self.sampling.top_p}"
        return decoding if self.tree is None else f"{decoding}, trees of {self.tree.label()}"

    def _engine_name(self) -> str:
        if self.engine == "vllm":
            return f"vLLM {(self.engine_info or {}).get('vllm_version', '?')}"
        return "the built-in decode"


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _at(values: Sequence[float], index: int) -> float | None:
    return values[index] if index < len(values) else None
