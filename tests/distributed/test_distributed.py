"""Multi-process runs as subprocess scripts (gloo on CPU), never inside the pytest process."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from benchmarks.two_process import CLIP  # the trainers' gradient_clip_val
from tests.support.builders import TINY_TARGETS
from tests.support.hang_guard import HANG_GUARD_S
from tests.support.probe_draft import NextTokenProbe

ROOT = Path(__file__).resolve().parents[2]


def run_script(script: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        # A script of tests/scripts by its name, any other by its path from the repository root.
        [sys.executable, str(ROOT / script if "/" in script else ROOT / "tests" / "scripts" / script), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


def test_ddp_metrics_equal_the_single_process_reference(tmp_path):
    run_script("ddp_validate.py", str(tmp_path / "one.json"), "1")
    two_processes = run_script("ddp_validate.py", str(tmp_path / "two.json"), "2")
    # Values already reduced across ranks are logged as such: no "use sync_dist=True" warning.
    assert "sync_dist=True" not in two_processes.stdout + two_processes.stderr
    one = json.loads((tmp_path / "one.json").read_text())
    two = json.loads((tmp_path / "two.json").read_text())
    for key in ("val/accept_len", "val/acc_pos0", "val/valid_tokens"):
        assert two[key] == one[key], key
    assert two["val/loss"] == pytest.approx(one["val/loss"], rel=1e-6)


def test_fsdp2_trains_saves_a_target_free_checkpoint_and_resumes(tmp_path):
    run_script("fsdp2_train.py", str(tmp_path), "train")
    checkpoint = torch.load(tmp_path / "fsdp2.ckpt", weights_only=False)
    assert set(checkpoint["state_dict"]) == {"head.weight", "head.bias"}
    # The save gathers no target tensor: neither the (sharded) decoder layers nor the embedding, final
    # norm and LM head are in the strategy's state dict.
    assert json.loads((tmp_path / "train.json").read_text()) == {
        "global_step": 3,
        "param_type": "DTensor",
        "gathered_target": [],
    }

    # A checkpoint written while state dicts still held the target (its keys, no whole-checkpoint digest)
    # resumes too, from its draft weights.
    target = NextTokenProbe(TINY_TARGETS["llama"]).target.model.state_dict()
    checkpoint["state_dict"].update({f"target.model.{k}": v for k, v in target.items()})
    del checkpoint["checkpoint_digest"]
    torch.save(checkpoint, tmp_path / "fsdp2.ckpt")
    run_script("fsdp2_train.py", str(tmp_path), "resume")
    resumed = json.loads((tmp_path / "resume.json").read_text())
    assert resumed["global_step"] == 5
    for name, value in checkpoint["state_dict"].items():
        if not name.startswith("target."):
            assert torch.equal(torch.tensor(resumed["start"][name]), value), name


DRAFTS = ("eagle3", "mla_eagle3", "eagle3_frozen_head", "dflash", "dflash2", "dspark")


SHARDED = ("fsdp2", "fsdp1")


def test_fsdp2_and_fsdp1_gradients_and_checkpoints_of_every_draft_equal_ddp(tmp_path):
    """Every draft trains under FSDP2 with sharded target layers and checkpointed draft layers, and under
    FSDP1 (Lightning's FSDPStrategy, the target's decoder layers its FSDP units, full state dicts): its
    step's gradients, clipped by norm as the recipes clip them, and its saved weights are DDP's (the block
    drafts chunked and differentiated in forward under FSDP2), its validation metrics are DDP's (FSDP2), the
    checkpoint holds no target weight, and a second step resumes from it. EAGLE-3 also trains with its LM
    head the tied target's rows and frozen: no strategy gives it a gradient or moves it."""
    for strategy in ("ddp", *SHARDED):
        (tmp_path / strategy).mkdir()
        run_script("distributed_grads.py", str(tmp_path / strategy), strategy)
    for draft, sharded in [(draft, sharded) for sharded in SHARDED for draft in DRAFTS]:
        check_against_ddp(tmp_path, draft, sharded)


def check_against_ddp(tmp_path: Path, draft: str, sharded: str) -> None:
    """One draft's step, checkpoints and validation under ``sharded`` (fsdp2 | fsdp1) against DDP's."""
    ddp = torch.load(tmp_path / "ddp" / f"{draft}.pt")
    other = torch.load(tmp_path / sharded / f"{draft}.pt")
    for step in (ddp, other):  # clipping acted: the gradients stepped with have the clip norm
        norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in step["grads"].values()]))
        assert norm == pytest.approx(CLIP, rel=1e-4), (draft, sharded, float(norm))
    assert other["target_sharded"] and not ddp["target_sharded"], draft
    # Under FSDP2 the draft's frozen copies (embedding, a frozen LM head) stay whole, out of its groups.
    assert other["frozen_draft_parameters"] == ddp["frozen_draft_parameters"], draft
    # Every EAGLE-3 draft keeps its embedding frozen (this test's DSpark trains its copies).
    assert bool(other["frozen_draft_parameters"]) == (draft in ("eagle3", "mla_eagle3", "eagle3_frozen_head"))
    if sharded == "fsdp2":
        assert other["frozen_draft_parameters_sharded"] == [], draft
    else:
        # FSDP1's backward prefetch never all-gathers a target unit (they never run backward): their forward
        # ran without grad, so none is marked for a pre-backward unshard; the draft's root is.
        marked = other["units_marked_for_backward"]
        assert marked["target"] and not any(marked["target"]), (draft, marked)
        assert marked["root"] == [True], (draft, marked)
    assert set(other["grads"]) == set(ddp["grads"]), draft
    for name, grad in ddp["grads"].items():
        assert grad.abs().max() > 0, f"{draft} {name} has no gradient"
        scale = grad.abs().max().item()
        torch.testing.assert_close(
            other["grads"][name], grad, rtol=1e-5, atol=1e-5 * scale, msg=f"{draft} {name}"
        )
    # The checkpoints hold the same draft (no target weights) after the step, and both resume.
    saved = {s: torch.load(tmp_path / s / f"{draft}.ckpt", weights_only=False) for s in ("ddp", sharded)}
    assert not [k for k in saved[sharded]["state_dict"] if k.startswith("target.")], draft
    assert set(saved[sharded]["state_dict"]) == set(saved["ddp"]["state_dict"]), draft
    # No save gathers a target tensor: none is in the strategy's state dict, none in FSDP1's root unit.
    for strategy in ("ddp", sharded):
        gathered = json.loads((tmp_path / strategy / f"{draft}-gathered.json").read_text())
        assert gathered == {"state_dict": [], "root_flat_parameter": []}, (draft, strategy)
    # Both steps started from the same weights.
    for name, value in ddp["weights_before"].items():
        torch.testing.assert_close(other["weights_before"][name], value, rtol=0, atol=0, msg=name)
    # Each strategy's saved weights are AdamW's step from its own gradients. The two are not compared
    # to each other with a plain tolerance: Adam's first step moves every element by about the
    # learning rate whatever the gradient's size, so a near-zero gradient element whose round-off
    # differs between the strategies moves by up to twice the learning rate (the gradients themselves
    # are held to 1e-5 above).
    for step in (ddp, other):
        assert step["adamw"] == ddp["adamw"], draft
    for strategy, step in (("ddp", ddp), (sharded, other)):
        state = saved[strategy]["state_dict"]
        for name, expected in adamw_first_step(step["weights_before"], step["grads"], step["adamw"]).items():
            torch.testing.assert_close(state[name], expected, rtol=1e-6, atol=1e-7, msg=f"{draft} {name}")
    for name, value in saved["ddp"]["state_dict"].items():
        if name not in ddp["grads"]:  # buffers and frozen weights: untouched by the step
            torch.testing.assert_close(saved[sharded]["state_dict"][name], value, rtol=0, atol=0)
    for strategy in ("ddp", sharded):
        resumed = torch.load(tmp_path / strategy / f"{draft}-resumed.ckpt", weights_only=False)
        assert resumed["global_step"] == 2, (draft, strategy)
        if draft == "eagle3_frozen_head":  # the tied target's rows, frozen: no gradient, unmoved by two steps
            head = torch.load(tmp_path / strategy / f"{draft}-target-head.pt")
            assert "draft.lm_head.weight" not in ddp["grads"] | other["grads"]
            for state in (saved[strategy]["state_dict"], resumed["state_dict"]):
                assert torch.equal(state["draft.lm_head.weight"], head), (draft, strategy)
        # The resumed fit starts from the saved weights, bit for bit.
        start = torch.load(tmp_path / strategy / f"{draft}-resumed-start.pt")
        assert start.keys() == ddp["grads"].keys(), (draft, strategy)
        for name, value in start.items():
            assert torch.equal(value, saved[strategy]["state_dict"][name]), (draft, strategy, name)
    if sharded == "fsdp1":
        return  # FSDPStrategy validates inside fit only (tests/scripts/distributed_grads.py)
    val = {s: json.loads((tmp_path / s / f"{draft}-val.json").read_text()) for s in ("ddp", sharded)}
    assert val[sharded].keys() == val["ddp"].keys() and "val/loss" in val["ddp"], draft
    for name, value in val["ddp"].items():
        assert val[sharded][name] == pytest.approx(value, rel=1e-5, abs=1e-6), (draft, name)


def adamw_first_step(
    weights: dict[str, torch.Tensor], grads: dict[str, torch.Tensor], adamw: dict
) -> dict[str, torch.Tensor]:
    """The weights after AdamW's first step (bias-corrected moments are g and g², so the update is
    lr * g / (|g| + eps)), computed from the formula, not by an optimizer."""
    lr, eps, decay = adamw["lr"], adamw["eps"], adamw["weight_decay"]
    return {
        name: weights[name] * (1 - lr * decay) - lr * grad / (grad.abs() + eps)
        for name, grad in grads.items()
    }


FSDP2_RECIPES = sorted(
    path
    for path in (ROOT / "configs" / "recipes").glob("*.yaml")
    # FSDP1 refuses CPU devices ("FSDP needs a non-CPU accelerator device"): GPU only.
    if "FSDPStrategy" not in path.read_text()
)


def test_every_fsdp2_recipe_fits_on_cpu_in_bf16(tmp_path):
    """Each GPU recipe as shipped (FSDP2, bf16-mixed, its draft hyperparameters and callbacks) with only
    the target, data, accelerator and run length shrunk, through `lightning-drafts fit` on 2 processes;
    the checkpoint holds the float32 master weights bf16-mixed keeps."""
    assert len(FSDP2_RECIPES) == 7
    run_script("recipe_on_cpu.py", str(tmp_path), *map(str, FSDP2_RECIPES))
    for recipe in FSDP2_RECIPES:
        (best,) = (tmp_path / recipe.stem).glob("runs/*/version_0/checkpoints/best*.ckpt")
        checkpoint = torch.load(best, weights_only=False)
        assert checkpoint["global_step"] == 2, recipe.stem
        state = checkpoint["state_dict"]
        assert state and not [k for k in state if k.startswith("target.")], recipe.stem
        floating = [v for v in state.values() if v.is_floating_point() and v.numel() > 1]
        assert all(v.dtype == torch.float32 for v in floating), recipe.stem
        events = EventAccumulator(str(best.parents[1]))
        events.Reload()
        assert {"train/loss", "val/loss", "val/accept_len"} <= set(events.Tags()["scalars"]), recipe.stem
        assert all(math.isfinite(e.value) for e in events.Scalars("train/loss")), recipe.stem
