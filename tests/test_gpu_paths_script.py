"""tools/gpu_paths.py, the GPU acceptance run, dry-run on a CPU: every check that has a CPU
forward passes, the CUDA-only ones are reported SKIP with their reason, and the JSON report holds the
versions, the device and each check's status, numbers and seconds; the time guard skips what would start
after the budget."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

from tests.support.hang_guard import HANG_GUARD_S

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tools" / "gpu_paths.py"
CPU_CHECKS = {
    "auto_resolves_as_documented",
    "rope_tables_stay_float32",
    "fused_target_equals_sdpa",
    "layer_kind_targets_equal_eager",
    "flex_kernel_equals_sdpa",
    "packed_equals_padded_under_flex",
    "flex_equals_sdpa_for_every_draft",
    "live_slots_equal_every_slot_under_flex",
    "bf16_mixed_follows_float32",
}
CUDA_CHECKS = {
    "one_gpu_fit_with_fsdp1_and_fsdp2",
    "real_shapes_step",
    "throughput_packed_vs_padded",
}


# The documented order: the cheapest and most informative first, the flex compiles after them.
ORDER = [
    "auto_resolves_as_documented",
    "rope_tables_stay_float32",
    "fused_target_equals_sdpa",
    "layer_kind_targets_equal_eager",
    "bf16_mixed_follows_float32",
    "one_gpu_fit_with_fsdp1_and_fsdp2",
    "flex_kernel_equals_sdpa",
    "packed_equals_padded_under_flex",
    "real_shapes_step",
    "flex_equals_sdpa_for_every_draft",
    "live_slots_equal_every_slot_under_flex",
    "throughput_packed_vs_padded",
]


def run(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "gpu_paths.json"
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"),
    }
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cpu", "--out", str(out), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
    )
    return proc, json.loads(out.read_text())


def test_the_cpu_dry_run_passes_every_check_with_a_cpu_forward(tmp_path):
    proc, report = run(tmp_path, "--quick")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    environment = report["environment"]
    assert environment["device"] == "cpu" and environment["device_name"]
    assert {"torch", "triton", "flash-attn", "transformers", "lightning"} <= environment["versions"].keys()
    assert environment["versions"]["torch"] == importlib.metadata.version("torch")
    status = {check["check"]: check for check in report["checks"]}
    assert status.keys() == CPU_CHECKS | CUDA_CHECKS
    for name in CPU_CHECKS:
        assert status[name]["status"] == "PASS", (name, status[name].get("error"))
    for name in CUDA_CHECKS:
        assert status[name]["status"] == "SKIP" and "CUDA" in status[name]["reason"], name
    assert all(check["seconds"] >= 0 for check in report["checks"])
    assert status["auto_resolves_as_documented"]["numbers"]["target"] == "sdpa"
    numbers = status["bf16_mixed_follows_float32"]["numbers"]
    assert numbers.keys() == {"eagle3", "dflash", "compiled_variants"}
    assert numbers["eagle3"]["max_relative_loss_gap"] < 0.02
    # Each check ran in a process of its own: the last one's compiled entry points are not the first one's.
    assert [check["check"] for check in report["checks"]] == [
        name for name in ORDER if name in CPU_CHECKS | CUDA_CHECKS
    ]
    gaps = status["fused_target_equals_sdpa"]["numbers"]
    assert gaps["backend"] == "flex" and all(max(gaps[f]) < 2**-5 for f in ("llama", "qwen3", "deepseek_v3"))


def test_the_time_guard_skips_what_would_start_after_the_budget(tmp_path):
    proc, report = run(
        tmp_path, "--budget", "0", "--checks", "auto_resolves_as_documented", "rope_tables_stay_float32"
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert [c["check"] for c in report["checks"]] == [
        "auto_resolves_as_documented",
        "rope_tables_stay_float32",
    ]
    assert all(c["status"] == "SKIP" and "budget" in c["reason"] for c in report["checks"])


def test_the_real_shapes_check_s_memory_plan_counts_at_least_the_weights_it_holds():
    """Check 9 (CUDA only) records the memory plan's peak beside the measured one: on a CPU, the plan of
    each of its steps at least holds the Llama-3.1-8B-wide target in bf16 and the draft's float32 weights and
    gradients, counted here from the target's sizes."""
    sys.path.insert(0, str(ROOT / "tools"))
    import gpu_paths

    config = gpu_paths.REAL_TARGET
    hidden, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    query, key = (
        config["num_attention_heads"] * config["head_dim"],
        config["num_key_value_heads"] * config["head_dim"],
    )
    layer = 2 * hidden * query + 2 * hidden * key + 3 * hidden * inter + 2 * hidden
    target_bytes = 2 * (2 * vocab * hidden + config["num_hidden_layers"] * layer + hidden)
    # EAGLE-3: fc (3H -> H), one decoder layer with a 2H-wide input, the 32,000-row head, a frozen embedding.
    eagle3 = 3 * hidden * hidden + layer + hidden * query + 32000 * hidden
    # DFlash: fc over 2 captured layers, 2 decoder layers.
    dflash = 2 * hidden * hidden + 2 * layer
    lengths = [3000, 1500, 2100, 1592]
    for name, trainable in (("eagle3", eagle3), ("dflash", dflash)):
        assert gpu_paths.planned_step_bytes(name, lengths) > target_bytes + 2 * 4 * trainable, name
