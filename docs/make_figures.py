"""Every figure of the docs, from one command: the Results plots from the tables the benchmarks recorded
(``benchmarks/*_RESULTS.md``), the packed-row picture from the project's own batch and mask code, and,
given a run, the EAGLE-3 quickstart's curves (``lightning-drafts plot``) and its export's model card.

    python docs/make_figures.py                                    # Results plots and the packed row
    python docs/make_figures.py --run runs/eagle3/version_0 --export runs/eagle3-export   # and the rest

Needs matplotlib (the ``plot`` extra). Writes into ``docs/assets/``.
"""

from __future__ import annotations

import argparse
import re
import shutil
import tempfile
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
ASSETS = ROOT / "docs" / "assets"
BENCHMARKS = ROOT / "benchmarks"
NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?")


def section(path: Path, heading: str | None = None) -> str:
    """The text of ``path`` under ``heading`` (up to the next heading of its level or above), or all of it."""
    text = path.read_text()
    if heading is None:
        return text
    match = re.search(rf"^(#+) {re.escape(heading)}\s*$", text, re.MULTILINE)
    if match is None:
        raise ValueError(f"{path} has no heading {heading!r}")
    rest = text[match.end() :]
    end = re.search(rf"^#{{1,{len(match.group(1))}}} ", rest, re.MULTILINE)
    return rest[: end.start()] if end else rest


def tables(text: str) -> list[list[dict[str, str]]]:
    """Every Markdown table in ``text`` as rows of ``header -> cell``."""
    found, lines = [], text.splitlines()
    for i in range(len(lines) - 1):
        if lines[i].startswith("|") and re.fullmatch(r"\|[-:| ]+\|", lines[i + 1].strip()):
            header = [c.strip() for c in lines[i].strip().strip("|").split("|")]
            rows = []
            for line in lines[i + 2 :]:
                if not line.startswith("|"):
                    break
                rows.append(
                    dict(zip(header, (c.strip() for c in line.strip().strip("|").split("|")), strict=False))
                )
            found.append(rows)
    return found


def table_with(text: str, *columns: str) -> list[dict[str, str]]:
    """The first table of ``text`` that has every one of ``columns``."""
    for rows in tables(text):
        if rows and all(c in rows[0] for c in columns):
            return rows
    raise ValueError(f"no table with the columns {columns}")


def number(cell: str, index: int = 0) -> float:
    """The ``index``-th number in a cell (``**2.060** (499 rounds)`` -> 2.06; ``99.95%`` -> 99.95)."""
    return float(NUMBER.findall(cell)[index].replace(",", ""))


def bars(path: Path, labels: list[str], series: dict[str, list[float]], ylabel: str, title: str, line=None):
    figure, axes = plt.subplots(
        figsize=(min(12, max(8, 0.4 * len(labels) * len(series))), 4.4), layout="constrained"
    )
    width = 0.8 / len(series)
    for i, (name, values) in enumerate(series.items()):
        positions = [x + (i - (len(series) - 1) / 2) * width for x in range(len(labels))]
        axes.bar(positions, values, width, label=name)
    axes.set_xticks(range(len(labels)), labels, rotation=30 if max(map(len, labels)) > 12 else 0, ha="right")
    if line is not None:
        axes.axhline(line, color="grey", linewidth=0.8)
    axes.set_ylabel(ylabel)
    axes.set_title(title)
    if len(series) > 1:
        axes.legend(fontsize="small")
    axes.grid(axis="y", alpha=0.3)
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path


def packing() -> Path:
    rows = table_with(
        section(BENCHMARKS / "PACKING_RESULTS.md"), "max_tokens", "micro-batch", "mode", "efficiency"
    )
    rows = [r for r in rows if r["micro-batch"] == "8"]
    widths = sorted({r["max_tokens"] for r in rows}, key=int)
    series = {
        mode: [
            number(next(r for r in rows if r["mode"] == mode and r["max_tokens"] == w)["efficiency"])
            for w in widths
        ]
        for mode in dict.fromkeys(r["mode"] for r in rows)
    }
    return bars(
        ASSETS / "packing-efficiency.png",
        [f"max_tokens {w}" for w in widths],
        series,
        "real tokens / token slots (%)",
        "Packing efficiency, micro-batch 8 (benchmarks/packing.py)",
    )


def throughput() -> Path:
    path = BENCHMARKS / "THROUGHPUT_RESULTS.md"
    eagle3 = table_with(section(path, "EAGLE-3, defaults, an idle machine"), "draft", "packed/padded (pairs)")
    blocks = table_with(
        section(path, "Block drafts, defaults, chunks differentiated in forward (after 75c6acc)"),
        "draft",
        "packed/padded (pairs)",
    )
    rows = eagle3 + blocks
    return bars(
        ASSETS / "throughput-packed-vs-padded.png",
        [r["draft"] for r in rows],
        {
            "packed / padded": [number(r["packed/padded (pairs)"]) for r in rows],
            "padding limit 1 / (1 - padding)": [number(r["limit 1/(1-p)"]) for r in rows],
        },
        "throughput ratio",
        "Packed vs padded training throughput, CPU (benchmarks/throughput.py)",
        line=1.0,
    )


def objectives() -> Path:
    rows = table_with(
        section(BENCHMARKS / "OBJECTIVES_RESULTS.md"),
        "draft",
        "objective",
        "val/accept_len before",
        "val/accept_len after",
    )
    return bars(
        ASSETS / "objectives-accept-len.png",
        [f"{r['draft']}: {r['objective']}" for r in rows],
        {
            "before": [number(r["val/accept_len before"]) for r in rows],
            "after 200 steps": [number(r["val/accept_len after"]) for r in rows],
        },
        "val/accept_len",
        "Every objective on a short CPU run (benchmarks/objectives.py)",
    )


def features() -> Path:
    rows = table_with(
        section(BENCHMARKS / "FEATURES_RESULTS.md", "benchmarks/features.py"), "draft", "features/online"
    )
    return bars(
        ASSETS / "features-speedup.png",
        [r["draft"] for r in rows],
        {"features / online tokens/s": [number(r["features/online"]) for r in rows]},
        "tokens/s ratio",
        "Training from bfloat16 features vs online (benchmarks/features.py)",
        line=1.0,
    )


def quickstarts() -> Path:
    rows = table_with(section(BENCHMARKS / "QUICKSTART_RESULTS.md"), "quickstart", "served `accept_len`")
    val = next(c for c in rows[0] if c.startswith("`val/accept_len`"))
    return bars(
        ASSETS / "quickstarts-accept-len.png",
        [r["quickstart"].strip("`") for r in rows],
        {
            "last val/accept_len": [number(r[val], 1) for r in rows],
            "served accept_len": [number(r["served `accept_len`"]) for r in rows],
        },
        "tokens per verify round",
        "Quickstarts on CPU (benchmarks/quickstarts.py)",
        line=1.0,
    )


def packed_row() -> Path:
    """Three documents and two padding slots in one row of 16: the batch keys and the attention mask, as
    ``validate_batch`` and ``block_causal_mask`` compute them."""
    import torch

    from lightning_drafts.attention.backends import block_causal_mask
    from lightning_drafts.core.batch import validate_batch

    lengths, width = [5, 4, 5], 16
    real = sum(lengths)
    batch = {
        "input_ids": torch.arange(1, width + 1)[None] * torch.tensor([[1] * real + [0] * (width - real)]),
        "attention_mask": torch.tensor([[1] * real + [0] * (width - real)]),
        # The answer tokens of each document: its second half.
        "loss_mask": torch.tensor([[0, 0, 1, 1, 1, 0, 0, 1, 1, 0, 0, 1, 1, 1, 0, 0]]),
        "position_ids": torch.tensor([[*range(5), *range(4), *range(7)]]),
        "seq_lens": torch.tensor([[5, 4, 7]]),
    }
    packed = validate_batch(batch, vocab_size=64)
    mask = block_causal_mask(packed.doc_ids)[0, 0]
    colors = ["#4C72B0", "#DD8452", "#55A868"]
    figure, (top, bottom) = plt.subplots(2, 1, figsize=(8, 8.2), height_ratios=[1.3, 3], layout="constrained")
    rows = {
        "document": [
            str(int(d)) if a else "pad"
            for d, a in zip(packed.doc_ids[0], packed.attention_mask[0], strict=True)
        ],
        "attention_mask": packed.attention_mask[0].int().tolist(),
        "loss_mask": packed.loss_mask[0].int().tolist(),
        "position_ids": packed.position_ids[0].int().tolist(),
        "doc_remaining": packed.doc_remaining[0].int().tolist(),
    }
    for r, (name, values) in enumerate(rows.items()):
        for t, value in enumerate(values):
            pad = not bool(packed.attention_mask[0, t])
            face = "#DDDDDD" if pad else colors[int(packed.doc_ids[0, t])]
            alpha = 0.9 if r == 0 else 0.35
            top.add_patch(plt.Rectangle((t, -r - 1), 1, 1, facecolor=face, alpha=alpha, edgecolor="white"))
            top.text(t + 0.5, -r - 0.5, str(value), ha="center", va="center", fontsize=8)
        top.text(-0.3, -r - 0.5, name, ha="right", va="center", fontsize=9, family="monospace")
    top.set_xlim(-4.5, width)
    top.set_ylim(-len(rows), 0)
    top.axis("off")
    top.set_title(
        f"One packed row: documents of {lengths} tokens, then {width - real} padding slots (seq_lens {batch['seq_lens'][0].tolist()})"
    )
    image = torch.ones(width, width, 3)
    for q in range(width):
        for k in range(width):
            if mask[q, k]:
                doc = int(packed.doc_ids[0, q])
                rgb = (
                    matplotlib.colors.to_rgb(colors[doc]) if packed.attention_mask[0, q] else (0.6, 0.6, 0.6)
                )
                image[q, k] = torch.tensor(rgb)
    bottom.imshow(image.numpy(), interpolation="nearest")
    bottom.set_xticks(range(width))
    bottom.set_yticks(range(width))
    bottom.tick_params(labelsize=7)
    bottom.set_xlabel("key position")
    bottom.set_ylabel("query position")
    bottom.set_title("block_causal_mask: a query sees earlier keys of its own document only")
    path = ASSETS / "packed-row.png"
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path


def quickstart_curves(run_dir: Path) -> Path:
    from lightning_drafts.cli.plot import plot_run

    with tempfile.TemporaryDirectory() as scratch:
        plots = plot_run(run_dir, scratch, title="EAGLE-3 quickstart (configs/quickstart/eagle3.yaml)")
        path = ASSETS / "eagle3-quickstart.png"
        shutil.copyfile(next(f for f in plots.files if f.name == "summary.png"), path)
    return path


def model_card(export_dir: Path) -> Path:
    """The export's card, with this checkout's absolute paths written relative to the repository."""
    path = ASSETS / "eagle3-model-card.txt"
    path.write_text((export_dir / "README.md").read_text().replace(str(ROOT) + "/", "./"))
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", type=Path, default=None, help="the EAGLE-3 quickstart's TensorBoard run")
    parser.add_argument("--export", type=Path, default=None, help="its export, evaluated (the model card)")
    args = parser.parse_args()
    ASSETS.mkdir(parents=True, exist_ok=True)
    written = [packing(), throughput(), objectives(), features(), quickstarts(), packed_row()]
    if args.run is not None:
        written.append(quickstart_curves(args.run))
    if args.export is not None:
        written.append(model_card(args.export))
    for path in written:
        print(f"wrote {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
