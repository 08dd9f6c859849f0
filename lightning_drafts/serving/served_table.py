"""The served results per prompt set and category: acceptance under both definitions in use, and output
tokens per second with the draft, without speculation and with vLLM's n-gram speculator.

The two acceptance lengths users compare:

* **pooled over tokens** (what vLLM and SGLang report): every round's emitted tokens (``accepted + 1``)
  summed over all requests, divided by all verify rounds: ``1 + sum(accepted) / rounds``. Long requests
  weigh in proportion to their rounds.
* **per-request mean** (SpecForge's): each request's own ``1 + sum(accepted) / rounds``, averaged over the
  requests that had a verify round. Every request weighs the same.

They differ whenever requests accept differently and have different numbers of rounds.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

SPEED_MODES = ("draft", "target", "ngram")
ALL_CATEGORIES = "all"
POOLED = "accept_len pooled over tokens (vLLM, SGLang: sum of emitted tokens / sum of verify rounds)"
PER_REQUEST = "accept_len per-request mean (SpecForge: mean over requests of each one's tokens / rounds)"


@dataclass(frozen=True)
class ServedRequest:
    """Which prompt set, category, question and turn one served request is."""

    prompt_set: str
    category: str
    question_id: str
    turn: int

    @property
    def group(self) -> tuple[str, str]:
        return (self.prompt_set, self.category)


@dataclass(frozen=True)
class ServedRow:
    """One line of the table; ``tokens_per_s`` maps a mode of :data:`SPEED_MODES` to output tokens/s
    (``None``: not measured), ``speedup`` is draft over target."""

    prompt_set: str
    category: str
    requests: int
    output_tokens: int
    accept_len_pooled: float | None
    accept_len_per_request: float | None
    acceptance_by_position: list[float]
    tokens_per_s: dict[str, float | None]
    speedup: float | None


def acceptance_lengths(accepted: Sequence[Sequence[int]]) -> tuple[float | None, float | None]:
    """``(pooled, per_request)`` acceptance lengths of requests whose rounds accepted ``accepted[i]``
    drafted tokens each (the module docstring defines both); ``None`` where no round was verified."""
    rounds = sum(len(a) for a in accepted)
    pooled = 1 + sum(sum(a) for a in accepted) / rounds if rounds else None
    own = [1 + sum(a) / len(a) for a in accepted if len(a)]
    return pooled, (sum(own) / len(own) if own else None)


def acceptance_by_position(accepted: Sequence[Sequence[int]], num_steps: int) -> list[float]:
    """Per drafted position ``k``: the share of rounds whose first ``k + 1`` drafted tokens were accepted."""
    counts = [a for request in accepted for a in request]
    return [sum(c > k for c in counts) / len(counts) if counts else 0.0 for k in range(num_steps)]


def served_rows(
    requests: Sequence[ServedRequest],
    accepted: Sequence[Sequence[int]],
    output_tokens: Mapping[str, Sequence[int]],
    seconds: Mapping[str, Mapping[tuple[str, str], float]],
    num_steps: int,
) -> list[ServedRow]:
    """One row per (prompt set, category) and, for a set of several categories, one for the whole set.

    Args:
        requests: what each request is; ``accepted[i]`` holds request ``i``'s rounds.
        output_tokens: per speed mode, the tokens each request generated in that mode.
        seconds: per speed mode, the decode time of each (prompt set, category) group.
    """
    groups: dict[tuple[str, str], list[int]] = {}
    for index, request in enumerate(requests):
        groups.setdefault(request.group, []).append(index)
    rows = []
    for prompt_set in dict.fromkeys(r.prompt_set for r in requests):
        keys = [key for key in groups if key[0] == prompt_set]
        for key in keys:
            rows.append(
                _row(prompt_set, key[1], groups[key], [key], accepted, output_tokens, seconds, num_steps)
            )
        if len(keys) > 1:
            members = [i for key in keys for i in groups[key]]
            rows.append(
                _row(prompt_set, ALL_CATEGORIES, members, keys, accepted, output_tokens, seconds, num_steps)
            )
    return rows


def _row(
    prompt_set: str,
    category: str,
    members: list[int],
    keys: list[tuple[str, str]],
    accepted: Sequence[Sequence[int]],
    output_tokens: Mapping[str, Sequence[int]],
    seconds: Mapping[str, Mapping[tuple[str, str], float]],
    num_steps: int,
) -> ServedRow:
    chosen = [accepted[i] for i in members]
    pooled, per_request = acceptance_lengths(chosen)
    speeds: dict[str, float | None] = {}
    for mode in SPEED_MODES:
        if mode not in seconds or mode not in output_tokens:
            speeds[mode] = None
            continue
        spent = sum(seconds[mode][key] for key in keys)
        made = sum(output_tokens[mode][i] for i in members)
        speeds[mode] = made / spent if spent > 0 else None
    draft, target = speeds["draft"], speeds["target"]
    return ServedRow(
        prompt_set=prompt_set,
        category=category,
        requests=len(members),
        output_tokens=sum(output_tokens["draft"][i] for i in members),
        accept_len_pooled=pooled,
        accept_len_per_request=per_request,
        acceptance_by_position=acceptance_by_position(chosen, num_steps),
        tokens_per_s=speeds,
        speedup=draft / target if draft is not None and target else None,
    )


HEADER = (
    "| prompt set | category | requests | output tokens | accept_len pooled | accept_len per-request | "
    "acceptance by position | tokens/s with draft | tokens/s without | tokens/s n-gram | speedup |"
)


def markdown_table(rows: Sequence[ServedRow], speed_engine: str) -> str:
    """The rows as a Markdown table, with what each column means under it."""
    lines = [HEADER, "|" + "---|" * 11]
    for row in rows:
        positions = ", ".join(f"{p:.2f}" for p in row.acceptance_by_position)
        speeds = [_number(row.tokens_per_s.get(mode), 1) for mode in SPEED_MODES]
        lines.append(
            f"| {row.prompt_set} | {row.category} | {row.requests} | {row.output_tokens} | "
            f"{_number(row.accept_len_pooled, 3)} | {_number(row.accept_len_per_request, 3)} | {positions} | "
            + " | ".join(speeds)
            + f" | {_number(row.speedup, 2)} |"
        )
    lines += [
        "",
        f"- {POOLED}.",
        f"- {PER_REQUEST}.",
        "- acceptance by position: share of verify rounds whose first k drafted tokens were all accepted.",
        f"- tokens/s: output tokens per second of decoding in {speed_engine}, with the draft, with the target "
        "alone on the same prompts, and with vLLM's n-gram speculator (`-`: not measured); speedup = with "
        "draft / without.",
    ]
    return "\n".join(lines)


def _number(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"
