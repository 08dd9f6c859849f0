"""The docs' notebook example (Training from Python) runs as written and its metrics read back."""

from __future__ import annotations

import csv
import re
from itertools import islice
from pathlib import Path

import pytest
import torch

from tests.support.acceptance_reference import accept_len_by_definition

PAGE = Path(__file__).resolve().parents[2] / "docs" / "getting-started" / "notebook.md"


def notebook_example() -> str:
    text = PAGE.read_text()
    match = re.search(r"<!-- notebook-example -->\n```python\n(.*?)```", text, re.DOTALL)
    assert match, f"{PAGE} lost its notebook example block"
    return match.group(1)


def test_the_notebook_example_trains_and_reads_metrics_back(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(compile(notebook_example(), str(PAGE), "exec"), namespace)

    trainer = namespace["trainer"]
    assert trainer.global_step == 8
    # The last validation run followed the last step: its accept_len is that of the final weights on the
    # two validation batches (chains pooled), by the definition written out.
    model, metrics = namespace["model"], namespace["metrics"]
    model.eval()
    with torch.no_grad():
        outputs = [model.compute_loss(batch) for batch in islice(namespace["data"].val_dataloader(), 2)]
    expected = accept_len_by_definition(outputs)
    assert float(metrics["val/accept_len"]) == pytest.approx(expected, rel=1e-6)
    assert f"val/accept_len = {expected:.3f}" in capsys.readouterr().out
    with open(namespace["history"]) as f:
        rows = list(csv.DictReader(f))
    losses = [float(r["train/loss"]) for r in rows if r.get("train/loss")]
    assert len(losses) >= 2
    assert any(r.get("train/accept_len") for r in rows)
