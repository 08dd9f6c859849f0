"""The ``lightning-drafts`` command itself: its help, and a console free of warnings our entry point causes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from tests.support.hang_guard import HANG_GUARD_S

ROOT = Path(__file__).resolve().parents[2]


def run(*code_or_args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run(
        [sys.executable, *code_or_args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
    )


def test_help_lists_every_subcommand_without_loading_torch():
    probe = (
        "import sys\n"
        "from lightning_drafts.cli.main import main\n"
        "main(['--help'])\n"
        "assert 'torch' not in sys.modules and 'lightning' not in sys.modules, 'help imported torch'\n"
    )
    result = run("-c", probe)
    assert result.returncode == 0, result.stderr
    for subcommand in ("fit", "validate", "export", "evaluate", "regenerate"):
        assert f"  {subcommand} " in result.stdout, subcommand


def test_an_unknown_subcommand_is_named():
    result = run("-m", "lightning_drafts", "fti")
    assert result.returncode != 0 and "unknown subcommand 'fti'" in result.stderr


def test_the_entry_point_lets_lightningcli_read_the_command_line():
    config = ROOT / "configs" / "quickstart" / "eagle3.yaml"
    result = run("-m", "lightning_drafts", "fit", f"--config={config}", "--print_config")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "class_path: lightning_drafts.Eagle3Module" in result.stdout
    # Passing sys.argv[1:] as `args` made LightningCLI warn that it is meant to run from Python.
    assert "args parameter is intended to run from within Python" not in result.stderr


# Warnings raised inside third-party code about third-party code, whatever the project does: Lightning
# 2.6 calls APIs that torch 2.13 and jsonargparse 4.49 deprecate. Anything else is a warning of ours.
THIRD_PARTY_WARNINGS = (
    "`isinstance(treespec, LeafSpec)` is deprecated",
    "was deprecated in v4.49.0",
    "By default only one JsonargparseDeprecationWarning per type is shown",
)

CONSOLE_RUN = """
import json, sys, warnings
from lightning_drafts.cli.main import main

seen = []
warnings.simplefilter("always")
warnings.showwarning = lambda message, category, filename, lineno, *rest: seen.append(
    f"{filename}:{lineno}: {category.__name__}: {message}"
)
work, config = sys.argv[1], sys.argv[2]


def cli(*args):
    sys.argv = ["lightning-drafts", *args]  # as the console script runs: LightningCLI reads sys.argv
    main()


common = [f"--config={config}", f"--trainer.logger.init_args.save_dir={work}",
          "--data.init_args.max_documents=200", f"--data.init_args.cache_dir={work}/cache"]
cli("fit", *common, "--trainer.max_steps=2", "--trainer.val_check_interval=2", "--trainer.limit_val_batches=1")
checkpoint = f"{work}/eagle3/version_0/checkpoints/best.ckpt"
cli("validate", *common, f"--ckpt_path={checkpoint}", "--trainer.limit_val_batches=1")
cli("export", checkpoint, f"{work}/export")
cli("evaluate", f"{work}/export", f"--config={config}", "--num-prompts=1", "--max-new-tokens=4",
    f"--cache-dir={work}/cache", f"--json={work}/served.json")
from lightning_drafts.serving.model_card import read_card
front, body = read_card(f"{work}/export")
print("CARD " + json.dumps({"front": front, "body": body}))
print("WARNINGS " + json.dumps(seen))
"""


def test_a_quickstart_fit_validate_export_evaluate_prints_no_warning_of_ours(tmp_path):
    config = ROOT / "configs" / "quickstart" / "eagle3.yaml"
    result = run("-c", CONSOLE_RUN, str(tmp_path), str(config))
    assert result.returncode == 0, result.stderr[-3000:]
    seen = json.loads(result.stdout.rsplit("WARNINGS ", 1)[1])
    ours = [w for w in seen if not any(known in w for known in THIRD_PARTY_WARNINGS)]
    assert ours == [], "\n".join(ours)
    console = result.stdout + result.stderr
    # Lightning's own bar printed a max_steps run as "Epoch 0/-2" and the logger version as a metric.
    assert "Epoch 0/-2" not in console and "v_num" not in console
    # Dependency notices no user can act on: torch's LeafSpec deprecation (Lightning's own call) and
    # Lightning's litlogger advertisement.
    assert "LeafSpec" not in console and not any("LeafSpec" in w for w in seen), console[-3000:]
    assert "litlogger" not in console, console[-3000:]

    # The export's model card, read back: what the checkpoint and evaluate's own report say.
    card = json.loads(result.stdout.rsplit("CARD ", 1)[1].split("\nWARNINGS ", 1)[0])
    front, body = card["front"], card["body"]
    assert front == {
        "base_model": "shipped:tiny-llama",
        "library_name": "lightning-drafts",
        "tags": ["speculative-decoding", "eagle3"],
    }
    checkpoint = torch.load(tmp_path / "eagle3/version_0/checkpoints/best.ckpt", weights_only=False)
    (score,) = [
        s["current_score"] for s in checkpoint["callbacks"].values() if s.get("monitor") == "val/accept_len"
    ]
    assert "| optimizer steps | 2 |" in body
    assert "| training data | the embedded chitchat-dataset corpus |" in body
    assert f"| `val/accept_len` at this checkpoint | {float(score):.3f} |" in body
    served = json.loads((tmp_path / "served.json").read_text())
    assert (
        f"| served `accept_len`, pooled over tokens (vLLM, SGLang) | {served['served']['accept_len']:.3f} |"
        in body
    )
    per_request = served["served"]["accept_len_per_request"]
    assert f"| served `accept_len`, per-request mean (SpecForge) | {per_request:.3f} |" in body
    # The config by its file name: the card travels with the export, this machine's paths do not.
    assert (
        f"| prompts | 1 from the validation split of `{Path(config).name}` |" in body
        and str(ROOT) not in body
    )
    # No path of this machine: the shipped target by a placeholder the card explains, the export by its folder.
    assert (
        "vllm serve TARGET_DIR --speculative-config "
        """'{"method": "eagle3", "model": "export", "num_speculative_tokens": 4}'"""
    ) in body
    assert "`TARGET_DIR`: the folder of the shipped target `shipped:tiny-llama`" in body
    serve = body.split("## Serve it", 1)[1].split("## Served acceptance", 1)[0]
    assert str(tmp_path) not in serve and str(ROOT) not in serve
