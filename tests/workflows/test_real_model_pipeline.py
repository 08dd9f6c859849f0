"""benchmarks/real_model.py, the real-model pipeline, at CI size: the tiny GGUF (30 layers, tied, ChatML)
in place of SmolLM2's, a few conversations in a ShareGPT file cut off inside its last record, a few steps,
two MT-Bench questions served by the built-in decode. Every stage runs (with ``--capture``: the fit from
the features captured once), the report holds MT-Bench's
categories with both acceptance definitions, a second run redoes nothing, and a fit asked for more steps
resumes from its last checkpoint instead of starting over."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from torch.utils.tensorboard import SummaryWriter

from lightning_drafts.datamodules.embedded import embedded_corpus_rows
from tests.support.hang_guard import HANG_GUARD_S

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "real_model.py"
STAGES = [
    "prompts",
    "convert",
    "regenerate",
    "capture-eagle3",
    "fit-eagle3",
    "export-eagle3",
    "evaluate-eagle3",
]
ROLES = {"user": "human", "assistant": "gpt", "system": "system"}


def cut_off_sharegpt(path: Path, count: int) -> list[dict]:
    """A ShareGPT JSON array of ``count`` conversations of the embedded corpus, cut inside the last one (as
    the packaged ShareGPT V3 file is); returns the records written whole."""
    records = []
    for index, row in enumerate(embedded_corpus_rows()):
        if index == count:
            break
        turns = [{"from": ROLES[m["role"]], "value": m["content"]} for m in row["messages"]]
        records.append({"id": str(index), "conversations": turns})
    text = json.dumps(records)
    path.write_text(text[: len(text) - 30])
    return records[:-1]


def pipeline(work: Path, gguf: Path, sharegpt: Path, steps: int) -> subprocess.CompletedProcess:
    command = [
        sys.executable, str(SCRIPT), "--gguf", str(gguf), "--work", str(work), "--sharegpt", str(sharegpt),
        "--conversations", "30", "--max-new-tokens", "12", "--steps", str(steps), "--families", "eagle3",
        "--num-prompts", "2", "--serve-tokens", "6", "--engine", "builtin", "--capture",
        "--fit-args", "--data.init_args.max_tokens=128", "--model.init_args.draft_vocab_size=1024",
        "--trainer.num_sanity_val_steps=0",
        "--trainer.limit_val_batches=1", "--trainer.log_every_n_steps=1",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=HANG_GUARD_S)


def test_the_pipeline_runs_every_stage_reports_mt_bench_and_resumes(tiny_gguf, tmp_path):
    gguf, _ = tiny_gguf
    whole = cut_off_sharegpt(tmp_path / "sharegpt.json", 45)
    work = tmp_path / "work"
    first = pipeline(work, gguf, tmp_path / "sharegpt.json", steps=3)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]

    # The first exchange of the first 30 whole conversations, in order.
    rows = [json.loads(line) for line in (work / "sharegpt.jsonl").read_text().splitlines()]
    expected = [r["conversations"][:2] for r in whole if r["conversations"][0]["from"] == "human"][:30]
    assert [row["conversations"] for row in rows] == expected

    stages = json.loads((work / "stages.json").read_text())
    assert list(stages) == STAGES and all(
        s["wall_s"] >= 0 and len(s["load_before"]) == 3 for s in stages.values()
    )
    served = json.loads((work / "results.json").read_text())["families"]["eagle3"]
    table = {row["category"]: row for row in served["table"]}
    assert {row["prompt_set"] for row in served["table"]} == {"mt-bench"} and "all" in table
    assert len(table) == 3 and served["num_steps"] == 4  # two categories (one question each) and "all"
    turns = sorted(request["turn"] for request in served["requests"])
    assert turns == [1, 1, 2, 2]
    # Pooled: the tokens every verify round emitted (its accepted drafts and the target's own), over the
    # rounds of all requests together.
    rounds = [accepted for request in served["accepted"] for accepted in request]
    assert len(rounds) == served["rounds"]
    assert abs(table["all"]["accept_len_pooled"] - sum(a + 1 for a in rounds) / len(rounds)) < 1e-9
    assert "accept_len pooled" in (work / "results.md").read_text()

    second = pipeline(work, gguf, tmp_path / "sharegpt.json", steps=3)
    assert second.returncode == 0, second.stderr[-3000:]
    assert all(f"{stage}: done before" in second.stdout for stage in STAGES), second.stdout

    # A fit killed before its last step, asked again: it goes on from last.ckpt to the new step count.
    stages.pop("fit-eagle3")
    (work / "stages.json").write_text(json.dumps(stages))
    third = pipeline(work, gguf, tmp_path / "sharegpt.json", steps=5)
    assert third.returncode == 0, third.stdout[-3000:] + third.stderr[-3000:]
    fits = [
        line for line in (work / "commands.log").read_text().splitlines() if " lightning_drafts fit " in line
    ]
    assert len(fits) == 2 and "--ckpt_path=" not in fits[0] and "--ckpt_path=" in fits[1], fits
    # Both fits trained from the one capture, without the target's decoder.
    features = work / "eagle3-features"
    assert all(f"--data.init_args.features_dir={features}" in fit for fit in fits), fits
    assert all("--model.init_args.target_decoder=false" in fit for fit in fits), fits
    manifest = json.loads((features / "features.json").read_text())
    assert manifest["data"]["max_tokens"] == 128 and manifest["sources"]["data_files"]["documents"] > 0, (
        manifest
    )
    last = work / "runs" / "real-eagle3" / "version_0" / "checkpoints" / "last.ckpt"
    assert torch.load(last, map_location="cpu", weights_only=False)["global_step"] == 5
    # The report's curve: a validation after every step (val_every = steps // 4, at least 1), placed at the
    # real tokens trained on, which grow by at most one batch (2 rows of 128 tokens) a step.
    curve = json.loads((work / "results.json").read_text())["curves"]["eagle3"]
    assert [step for step, _, _ in curve] == [0, 1, 2, 3, 4], curve
    tokens = [count for _, count, _ in curve]
    assert 0 < tokens[0] <= 256 and all(0 < b - a <= 256 for a, b in zip(tokens, tokens[1:], strict=False))
    assert (work / "accept_len_by_tokens.png").read_bytes()[:4] == b"\x89PNG"


def test_the_report_covers_every_family_served_in_the_work_directory(tmp_path):
    """A family served by an earlier run in the same work directory (each family's own fit options) is
    reported beside this run's, each with its validation curve at the real tokens it trained on."""
    spec = importlib.util.spec_from_file_location("real_model", SCRIPT)
    real_model = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(real_model)
    # Values a float32 event stores exactly.
    for family, values in (("eagle3", [1.125, 1.25]), ("dflash", [1.0625, 1.375])):
        (tmp_path / f"{family}-served").mkdir()
        (tmp_path / f"{family}-served" / "served.json").write_text(json.dumps({"family": family}))
        (tmp_path / f"{family}-served" / "served.md").write_text(f"| {family} table |")
        writer = SummaryWriter(str(tmp_path / "runs" / f"real-{family}" / "version_0"))
        for step in (9, 19):  # 500 real tokens a step
            writer.add_scalar("train/tokens_seen", 500.0 * (step + 1), step)
        for step, value in zip((9, 19), values, strict=True):
            writer.add_scalar("val/accept_len", value, step)
        writer.close()
    real_model.report(tmp_path, ["eagle3"], {}, "vllm")
    results = json.loads((tmp_path / "results.json").read_text())
    assert list(results["families"]) == ["eagle3", "dflash"]
    assert results["curves"]["dflash"] == [[9, 5000, 1.0625], [19, 10000, 1.375]]
    text = (tmp_path / "results.md").read_text()
    assert "| dflash table |" in text and "| 19 | 10,000 | 1.375 |" in text
