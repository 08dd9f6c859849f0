"""The README's notebook example runs as written and its metrics read back."""

from __future__ import annotations

import csv
import re
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"


def notebook_example() -> str:
    text = README.read_text()
    match = re.search(r"<!-- notebook-example -->\n```python\n(.*?)```", text, re.DOTALL)
    assert match, "README.md lost its notebook example block"
    return match.group(1)


def test_readme_notebook_example_trains_and_reads_metrics_back(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(compile(notebook_example(), "README.md", "exec"), namespace)

    trainer = namespace["trainer"]
    assert trainer.global_step == 8
    assert float(namespace["metrics"]["val/accept_len"]) >= 1.0
    assert "val/accept_len = " in capsys.readouterr().out
    with open(namespace["history"]) as f:
        rows = list(csv.DictReader(f))
    losses = [float(r["train/loss"]) for r in rows if r.get("train/loss")]
    assert len(losses) >= 2
    assert any(r.get("train/accept_len") for r in rows)
