"""A grid of SGLang tree settings served from one draft on the same prompts (``evaluate --sweep``): the
acceptance each buys and the draft tokens the target verifies per round to buy it, so a tree can be
chosen without a GPU sweep."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from lightning_drafts.serving.draft_tree import TreeShape
from lightning_drafts.serving.report import EvaluationReport

# SGLang's chain settings (topk 1) and trees of a few widths and budgets around its common EAGLE-3 ones.
DEFAULT_SWEEP = (
    TreeShape(3, 1, 4),
    TreeShape(5, 1, 6),
    TreeShape(3, 4, 8),
    TreeShape(5, 4, 8),
    TreeShape(5, 4, 16),
    TreeShape(5, 8, 32),
)


@dataclass(frozen=True)
class SweepRow:
    """One tree setting's served results (``None``: no verify round)."""

    num_steps: int
    topk: int
    num_draft_tokens: int
    rounds: int
    output_tokens: int
    accept_len_pooled: float | None
    accept_len_per_request: float | None
    draft_tokens_per_round: float | None
    lossless: bool | None

    @classmethod
    def of(cls, shape: TreeShape, report: EvaluationReport) -> SweepRow:
        verified = sum(sum(p) for p in report.proposed)
        return cls(
            shape.num_steps,
            shape.topk,
            shape.num_draft_tokens,
            report.rounds,
            report.generated_tokens,
            report.served.accept_len,
            report.served.accept_len_per_request,
            verified / report.rounds if report.rounds else None,
            report.lossless,
        )


def sweep_markdown(rows: Sequence[SweepRow]) -> str:
    lines = [
        "| num_steps | topk | num_draft_tokens | accept_len pooled | accept_len per-request "
        "| draft tokens verified per round | rounds | output tokens | lossless |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        cells = [row.num_steps, row.topk, row.num_draft_tokens]
        cells += [_number(row.accept_len_pooled), _number(row.accept_len_per_request)]
        cells += [_number(row.draft_tokens_per_round), row.rounds, row.output_tokens]
        cells.append("-" if row.lossless is None else ("yes" if row.lossless else "NO"))
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def write_sweep(rows: Sequence[SweepRow], directory: str | Path, title: str) -> tuple[Path, Path]:
    """``sweep.json`` (the rows) and ``sweep.md`` (the table under ``title``) in ``directory``."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    data, markdown = directory / "sweep.json", directory / "sweep.md"
    data.write_text(json.dumps([asdict(r) for r in rows], indent=2) + "\n")
    markdown.write_text(f"# {title}\n\n{sweep_markdown(rows)}\n")
    return data, markdown


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"
