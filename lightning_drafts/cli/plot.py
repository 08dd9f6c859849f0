"""``lightning-drafts plot``: the curves a user reads to judge a draft, drawn from a run's TensorBoard
event files into PNG files (matplotlib, the ``plot`` extra).

Examples::

    lightning-drafts plot runs/eagle3/version_0 --out plots/eagle3
    lightning-drafts plot runs/eagle3 --out plots/eagle3      # the newest version_N under it

Writes ``loss.png`` (``train/loss``, ``val/loss``), ``accept_len.png`` (``val/accept_len``, and
``val/served_accept_len`` when logged), ``acceptance_by_position.png`` (``val/acc_pos{k}`` over steps) and
``summary.png`` (the three side by side); with ``train/tokens_seen`` logged (``ThroughputCallback``), also
``accept_len_by_tokens.png``: the acceptance length against the real tokens trained on, the axis on which
runs of different batch and world sizes compare.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from lightning_drafts.cli.arguments import CommandParser

Series = list[tuple[int, float]]

LOSS_TAGS = ("train/loss", "val/loss")
ACCEPT_TAGS = ("val/accept_len", "val/served_accept_len")
POSITION_TAG = re.compile(r"val/acc_pos(\d+)$")
TOKENS_TAG = "train/tokens_seen"


@dataclass(frozen=True)
class RunCurves:
    """The scalars a plot draws, as ``(step, value)`` pairs in step order, read from one run."""

    run_dir: Path
    loss: dict[str, Series]
    accept_len: dict[str, Series]
    by_position: dict[int, Series]
    tokens_seen: Series

    def accept_len_by_tokens(self) -> dict[str, Series]:
        """Each acceptance-length point at the tokens trained on by its step: ``tokens_seen`` is logged
        every ``log_every_n_steps`` and grows by about one batch per step, so a validation step between two
        logged steps is placed on the straight line between them (beyond the last one, at the last one)."""
        if not self.tokens_seen:
            return {}
        steps = [float(step) for step, _ in self.tokens_seen]
        tokens = [value for _, value in self.tokens_seen]
        return {
            tag: [(round(float(np.interp(step, steps, tokens))), value) for step, value in points]
            for tag, points in self.accept_len.items()
        }


@dataclass(frozen=True)
class Plots:
    """What :func:`plot_run` drew: the PNG files and the curves they show."""

    files: list[Path]
    curves: RunCurves


def event_dir(run_dir: str | Path) -> Path:
    """``run_dir`` itself when it holds event files, else its newest ``version_N`` that does."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"{run_dir} is not a directory; give a run's log directory, e.g. runs/eagle3")
    if any(run_dir.glob("events.out.tfevents.*")):
        return run_dir
    versions = [d for d in run_dir.glob("version_*") if any(d.glob("events.out.tfevents.*"))]
    if not versions:
        raise FileNotFoundError(
            f"{run_dir} holds no TensorBoard event file (events.out.tfevents.*) nor a version_N directory "
            "with one; give the logger's log directory, e.g. runs/eagle3/version_0"
        )
    return max(versions, key=lambda d: int(d.name[8:]) if d.name[8:].isdigit() else -1)


def read_curves(run_dir: str | Path) -> RunCurves:
    """The loss, acceptance-length and per-position acceptance scalars of a run's event files."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    directory = event_dir(run_dir)
    events = EventAccumulator(str(directory), size_guidance={"scalars": 0})
    events.Reload()
    tags = events.Tags()["scalars"]

    def series(tag: str) -> Series:
        return sorted((event.step, float(event.value)) for event in events.Scalars(tag))

    by_position = {int(m.group(1)): series(t) for t in tags if (m := POSITION_TAG.match(t))}
    curves = RunCurves(
        run_dir=directory,
        loss={tag: series(tag) for tag in LOSS_TAGS if tag in tags},
        accept_len={tag: series(tag) for tag in ACCEPT_TAGS if tag in tags},
        by_position=dict(sorted(by_position.items())),
        tokens_seen=series(TOKENS_TAG) if TOKENS_TAG in tags else [],
    )
    if not curves.loss and not curves.accept_len:
        raise ValueError(
            f"{directory} logs none of {LOSS_TAGS + ACCEPT_TAGS} (its scalars: {sorted(tags)[:8]}); "
            "is it a lightning-drafts fit run?"
        )
    return curves


def _pyplot():
    try:
        import matplotlib
    except ImportError as error:
        raise SystemExit(
            "lightning-drafts plot needs matplotlib: pip install 'lightning-drafts[plot]' "
            "(or pip install matplotlib)"
        ) from error
    matplotlib.use("Agg")  # files only: no display is needed or used
    import matplotlib.pyplot as plt

    return plt


def _draw(axes, curves: dict, title: str, ylabel: str, label=str, xlabel: str = "step") -> None:
    for key, points in curves.items():
        axes.plot(
            [s for s, _ in points],
            [v for _, v in points],
            marker="." if len(points) < 40 else None,
            label=label(key),
        )
    axes.set_title(title)
    axes.set_xlabel(xlabel)
    axes.set_ylabel(ylabel)
    axes.grid(alpha=0.3)
    if curves:
        axes.legend(fontsize="small")


def plot_run(run_dir: str | Path, out_dir: str | Path, title: str | None = None) -> Plots:
    """Read ``run_dir``'s events and write the four PNG files into ``out_dir``."""
    curves = read_curves(run_dir)
    plt = _pyplot()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    panels = [
        ("loss", lambda ax: _draw(ax, curves.loss, "loss", "loss")),
        ("accept_len", lambda ax: _draw(ax, curves.accept_len, "acceptance length", "tokens per round")),
        (
            "acceptance_by_position",
            lambda ax: _draw(
                ax, curves.by_position, "acceptance by position", "accuracy", label=lambda k: f"acc_pos{k}"
            ),
        ),
    ]
    by_tokens = curves.accept_len_by_tokens()
    alone = [] if not by_tokens else [(
        "accept_len_by_tokens",
        lambda ax: _draw(ax, by_tokens, "acceptance length", "tokens per round", xlabel="real tokens trained on"),
    )]  # fmt: skip
    files = []
    for name, draw in panels + alone:
        figure, axes = plt.subplots(figsize=(5, 3.5), layout="constrained")
        draw(axes)
        files.append(out_dir / f"{name}.png")
        figure.savefig(files[-1], dpi=100)
        plt.close(figure)
    figure, row = plt.subplots(1, 3, figsize=(14, 3.6), layout="constrained")
    for axes, (_, draw) in zip(row, panels, strict=True):
        draw(axes)
    if title:
        figure.suptitle(title)
    files.append(out_dir / "summary.png")
    figure.savefig(files[-1], dpi=100)
    plt.close(figure)
    return Plots(files=files, curves=curves)


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(
        prog="lightning-drafts plot",
        description="Draw a run's loss, val/accept_len and acceptance-by-position curves from its TensorBoard "
        "event files into PNG files (needs matplotlib: the plot extra).",
    )
    parser.add_argument("run_dir", help="a run's log directory (runs/eagle3/version_0), or its parent")
    parser.add_argument("--out", required=True, help="the directory to write the PNG files into")
    parser.add_argument("--title", default=None, help="a title over summary.png")
    return parser


def plot_main(args: list[str]) -> None:
    parsed = build_parser().parse_args(args)
    plots = plot_run(parsed.run_dir, parsed.out, title=parsed.title)
    print(f"plotted {plots.curves.run_dir} -> " + ", ".join(str(f) for f in plots.files))
