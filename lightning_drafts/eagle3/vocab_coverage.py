"""Whether the draft vocabulary covers the target's greedy next tokens on the data, judged once, early.

A compressed draft vocabulary is chosen from the data's token frequencies, but what the draft must
predict is the *target's* greedy next token. A position whose greedy token lies outside the draft
vocabulary can never be drafted: it leaves the loss (so the loss and ``accuracy`` look fine) and is a
miss at its chain position. The teacher already computes the bit for every supervised position
(``TeacherSignal.in_draft_vocab``), so the figure costs nothing; it is summed over the first training
micro-batches and a low one is reported once, while the run is still young.
"""

from __future__ import annotations

from dataclasses import dataclass

# Micro-batches the figure is summed over: enough positions for a stable share, early in the run.
MICRO_BATCHES = 16
# Below this share of greedy tokens the acceptance ceiling is visibly lower than the full vocabulary's.
LOW_COVERAGE = 0.9


@dataclass
class CoverageCheck:
    """Sums the covered and supervised positions of the first ``micro_batches``, then judges them once."""

    draft_vocab_size: int
    vocab_size: int
    micro_batches: int = MICRO_BATCHES
    threshold: float = LOW_COVERAGE
    covered: float = 0.0
    supervised: float = 0.0
    seen: int = 0
    judged: bool = False

    def add(self, covered: float, supervised: float) -> str | None:
        """Count one micro-batch; the warning to give, once, when the window closes on a low coverage."""
        if self.judged:
            return None
        self.covered += covered
        self.supervised += supervised
        self.seen += 1
        return self.judge() if self.seen >= self.micro_batches else None

    def judge(self) -> str | None:
        """The warning for the positions counted so far (``None`` if the coverage is fine or nothing was
        counted); later calls return ``None``."""
        if self.judged or self.supervised == 0:
            return None
        self.judged = True
        coverage = self.covered / self.supervised
        if coverage >= self.threshold:
            return None
        return (
            f"the draft vocabulary ({self.draft_vocab_size} of {self.vocab_size} target ids) covers "
            f"{coverage:.0%} of the target's greedy next tokens on the first {self.seen} training "
            f"micro-batches ({int(self.supervised):,} supervised positions); the others can never be "
            "drafted, so acceptance is capped (train/draft_vocab_coverage logs the figure): raise "
            "draft_vocab_size"
        )
