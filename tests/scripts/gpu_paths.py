"""The GPU acceptance run: one GPU, under 8 minutes, cheapest proofs first.

    python tests/scripts/gpu_paths.py                        # on CUDA: every check below
    python tests/scripts/gpu_paths.py --device cpu [--quick] # every check that has a CPU forward

Results go to ``--out`` (default ``$OUT/gpu_paths.json``, else ``./gpu_paths.json``), rewritten after every
check, so a run cut off keeps what it proved: the versions (torch, triton, flash-attn, transformers,
lightning), the device, and per check PASS / FAIL / SKIP, its numbers and its seconds. A check that would
start after ``--budget`` seconds is skipped (the time guard). Inductor's cache lives in a persistent
directory (``TORCHINDUCTOR_CACHE_DIR``, default ``.cache/inductor`` in the repository), so a second run
compiles nothing; a dynamo recompile-limit hit fails the check that hit it instead of silently running
flex unfused.

Checks, in order:

1. ``auto`` resolves as documented: flash-attn varlen target where flash-attn is installed, else flex, on
   CUDA (SDPA on a CPU); block drafts: flex on CUDA;
2. the frozen target's rope tables stay float32 in a bf16 target after the bf16-true cast, on the device;
3. flex == SDPA at the kernel: the drafts' compiled entry points (with and without the log-sum-exp) on a
   packed multi-document mask over 2,048 tokens, outputs, log-sum-exp and gradients (CPU: forward only,
   no log-sum-exp: CPU inductor compiles neither);
4. packed == padded under flex for every draft over rows of 2,048 tokens (multi-block masks, partial
   blocks at document edges, DFlash's sliding-window block mask): loss, every draft gradient, the
   chains (CPU: loss and chains);
5. flex == SDPA for every draft on the same packed batch (loss and chains);
6. EAGLE-3 / MLA-EAGLE-3 at live TTT slots only == every slot at every step, under flex;
7. the flash-attn varlen target == the SDPA target (bf16) for a Llama, a Qwen3 and a DeepSeek-V3 target:
   every captured layer and the final-norm state, at real tokens (flash-attn installed only);
8. ``bf16-mixed`` vs float32 over 20 optimizer steps through Lightning (EAGLE-3 and DFlash): the loss
   stays close and every trainable weight moved, the RMSNorm gains included;
9. a 1-GPU ``fit`` with ``FSDPStrategy`` (FSDP1, bf16-mixed, clipping by norm) and with
   ``ModelParallelStrategy`` (FSDP2, ``shard_target``): a few steps, a checkpoint without target
   weights, and a resumed run (CUDA only);
10. ``benchmarks/throughput.py --device cuda``: packed vs padded tokens per second and peak memory
    (CUDA only).

The exit code is the number of failed checks.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Before torch is imported: inductor reads its cache directory from the environment.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(ROOT / ".cache" / "inductor"))
sys.path.insert(0, str(ROOT))

import lightning as L  # noqa: E402
import torch  # noqa: E402

from lightning_drafts import (  # noqa: E402
    DFlash2Module,
    DFlashModule,
    DSparkModule,
    Eagle3Module,
    MLAEagle3Module,
)
from lightning_drafts.attention.backends import (  # noqa: E402
    block_causal_mask,
    block_mask_from_mask_mod,
    compiled_flex_attention,
    document_causal_mask_mod,
    flash_attn_available,
    flex_attention_for,
    resolve_backend,
)
from lightning_drafts.attention.block_masks import resolve_block_backend  # noqa: E402
from lightning_drafts.core.batch import validate_batch  # noqa: E402
from lightning_drafts.training.target import ROPE_TABLES, FrozenTarget  # noqa: E402
from tests.block_draft_cases import BLOCK, MASK_TOKEN, perturb, to_padded, twins  # noqa: E402
from tests.builders import TINY_TARGETS, packed_row, padded_rows, random_docs, stack_rows  # noqa: E402
from tests.eagle3_checks import frequencies  # noqa: E402

EAGLE3 = {"eagle3": (Eagle3Module, "llama"), "mla_eagle3": (MLAEagle3Module, "deepseek_v3")}
BLOCK_DRAFTS = {
    "dflash": (DFlashModule, {}),
    "dflash_window": (DFlashModule, {"sliding_window": 96}),
    "dflash2": (DFlash2Module, {"conv_group_size": 4, "selector_rank": 8, "selector_top_k": 4}),
    "dspark": (DSparkModule, {}),
}
FAMILIES = ("llama", "qwen3", "deepseek_v3")


class Skipped(Exception):
    """A check that cannot run on this machine (reported, not counted as a failure)."""


class Run:
    """What every check reads: the device, the sizes (``--quick``: short rows, few steps) and a place
    for the numbers the check reports."""

    def __init__(self, device: str, quick: bool) -> None:
        self.device = device
        self.cuda = device == "cuda"
        self.quick = quick
        self.numbers: dict = {}

    @property
    def long_docs(self) -> list[int]:
        """Document lengths of one packed row: 2,048 tokens (many 128-token flex blocks, documents ending
        inside a block); ``--quick``: 28."""
        return [7, 5, 9, 4] if self.quick else [700, 517, 303, 528]

    @property
    def block_rows(self) -> tuple[list[list[int]], int]:
        if self.quick:
            return [[9, 6, 3], [11, 7], [10, 8]], 20
        return [[999, 701, 348], [1501, 3, 542]], 2048

    def need_cuda(self, what: str) -> None:
        if not self.cuda:
            raise Skipped(f"{what} runs on CUDA only")


def on(batch: dict, device: str) -> dict:
    return {key: value.to(device) for key, value in batch.items()}


def eagle3(name: str, backend: str, run: Run, **options) -> torch.nn.Module:
    module_class, family = EAGLE3[name]
    torch.manual_seed(0)
    module = module_class(
        {**TINY_TARGETS[family], "max_position_embeddings": 4096},
        ttt_length=3,
        draft_vocab_size=48,
        token_frequencies=frequencies(),
        target_attn_backend=backend,
        draft_attn_backend=backend,
        **options,
    )
    return module.to(run.device)


def block_draft(name: str, backend: str, run: Run) -> torch.nn.Module:
    module_class, options = BLOCK_DRAFTS[name]
    torch.manual_seed(0)
    module = module_class(
        {**TINY_TARGETS["qwen3"], "max_position_embeddings": 4096},
        mask_token_id=MASK_TOKEN,
        num_draft_layers=2,
        block_size=BLOCK,
        num_anchors=3,
        target_attn_backend=backend,
        draft_attn_backend=backend,
        logits_chunk_blocks=2,  # several chunks: gradients taken in forward, on the GPU too
        **options,
    )
    perturb(module)
    return module.to(run.device)


def objective(module: torch.nn.Module, batch: dict, anchors=None, backward: bool = True):
    module.zero_grad(set_to_none=True)
    with torch.set_grad_enabled(backward):
        output = (
            module.compute_loss(batch) if anchors is None else module.compute_loss(batch, anchors=anchors)
        )
        if backward:
            output.loss.backward()
    grads = {n: p.grad.clone() for n, p in module.draft.named_parameters() if p.grad is not None}
    return output, grads


def assert_same(first, second, backward: bool) -> float:
    """Loss, chains and (``backward``) every draft gradient equal; returns the largest relative gradient
    difference."""
    (a, grads_a), (b, grads_b) = first, second
    torch.testing.assert_close(a.loss, b.loss, rtol=1e-5, atol=1e-6)
    assert torch.equal(a.valid.cpu(), b.valid.cpu()) and torch.equal(a.correct.cpu(), b.correct.cpu())
    worst = 0.0
    if backward:
        assert grads_a.keys() == grads_b.keys() and grads_a, "no gradients"
        for name, grad in grads_b.items():
            scale = max(grad.abs().max().item(), 1e-6)
            torch.testing.assert_close(grads_a[name], grad, rtol=1e-4, atol=1e-5 * scale, msg=name)
            worst = max(worst, (grads_a[name] - grad).abs().max().item() / scale)
    return worst


def eagle3_twins(run: Run) -> tuple[dict, dict]:
    lengths = run.long_docs
    docs = random_docs(lengths, seed=1)
    return on(packed_row(docs, sum(lengths)), run.device), on(padded_rows(docs, max(lengths)), run.device)


def block_twins(module: torch.nn.Module, run: Run) -> tuple[dict, dict, torch.Tensor, torch.Tensor]:
    """The packed / padded twins and the same anchors in both, drawn by the module's own sampler (DSpark's
    rules differ from DFlash's)."""
    rows, width = run.block_rows
    packed_batch, padded_batch = twins(rows, width=width)
    packed = validate_batch(packed_batch)
    anchors = module.sample_anchors(packed, generator=torch.Generator().manual_seed(0)).cpu()
    padded_anchors, _ = to_padded(packed, anchors)
    return (
        on(packed_batch, run.device),
        on(padded_batch, run.device),
        anchors.to(run.device),
        padded_anchors.to(run.device),
    )


# --- the checks, cheapest first ---------------------------------------------------------------------


def check_auto_resolves_as_documented(run: Run) -> None:
    expected = ("flash" if flash_attn_available() else "flex") if run.cuda else "sdpa"
    resolved = resolve_backend("auto", run.device)
    block = resolve_block_backend("auto", run.device)
    run.numbers.update(target=resolved, block_drafts=block, flash_attn_installed=flash_attn_available())
    assert resolved == expected, f"auto resolved to {resolved!r}, documented {expected!r}"
    assert block == ("flex" if run.cuda else "sdpa"), block
    for name in EAGLE3:
        assert eagle3(name, "auto", run)._draft_backend(torch.device(run.device)) == block, name


def check_rope_tables_stay_float32(run: Run) -> None:
    from lightning.pytorch.plugins.precision import HalfPrecision

    for family in FAMILIES:
        target = FrozenTarget({**TINY_TARGETS[family], "max_position_embeddings": 4096}, dtype="bfloat16")
        target = HalfPrecision("bf16-true").convert_module(target.to(run.device))
        tables = {n: b for n, b in target.model.named_buffers() if n.rsplit(".", 1)[-1] in ROPE_TABLES}
        assert tables, family
        wrong = {n: str(b.dtype) for n, b in tables.items() if b.dtype != torch.float32}
        assert not wrong, f"{family}: {wrong}"


def check_flex_kernel_equals_sdpa(run: Run) -> None:
    lengths = run.long_docs
    doc_ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None].to(run.device)
    width = doc_ids.shape[1]
    mask = block_mask_from_mask_mod(
        document_causal_mask_mod(doc_ids), 1, width, width, torch.device(run.device)
    )
    dense = block_causal_mask(doc_ids)
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, width, 16, generator=generator).to(run.device) for _ in range(3))
    scale = 16**-0.5
    # --quick on a CPU: the eager kernel (the compiled one costs a minute there; tests/attention compiles it).
    flex = flex_attention_for(torch.device(run.device)) if run.quick else compiled_flex_attention()
    with torch.no_grad():
        out = flex(q, k, v, mask, scale)
        reference = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=dense, scale=scale)
    torch.testing.assert_close(out, reference, rtol=2e-5, atol=2e-5)
    run.numbers["max_abs_diff_out"] = (out - reference).abs().max().item()
    if not run.cuda:
        return
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out, lse = compiled_flex_attention(with_lse=True)(*leaves, mask, scale)
    (out.square().sum() + lse.sum()).backward()
    flex_grads = [x.grad for x in leaves]
    ref_leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    scores = (ref_leaves[0] @ ref_leaves[1].transpose(-1, -2) * scale).masked_fill(~dense, float("-inf"))
    ref_lse = torch.logsumexp(scores, dim=-1)
    ref_out = torch.softmax(scores, dim=-1) @ ref_leaves[2]
    (ref_out.square().sum() + ref_lse.sum()).backward()
    torch.testing.assert_close(lse, ref_lse, rtol=2e-5, atol=2e-5)
    for name, grad, ref in zip("qkv", flex_grads, (x.grad for x in ref_leaves), strict=True):
        torch.testing.assert_close(grad, ref, rtol=1e-4, atol=1e-4, msg=name)
        run.numbers[f"max_abs_diff_grad_{name}"] = (grad - ref).abs().max().item()


def check_packed_equals_padded_under_flex(run: Run) -> None:
    for name in EAGLE3:
        module = eagle3(name, "flex", run)
        packed, padded = eagle3_twins(run)
        run.numbers[name] = assert_same(
            objective(module, packed, None, run.cuda), objective(module, padded, None, run.cuda), run.cuda
        )
    for name in BLOCK_DRAFTS:
        module = block_draft(name, "flex", run)
        packed, padded, anchors, padded_anchors = block_twins(module, run)
        run.numbers[name] = assert_same(
            objective(module, packed, anchors, run.cuda),
            objective(module, padded, padded_anchors, run.cuda),
            run.cuda,
        )


def check_flex_equals_sdpa_for_every_draft(run: Run) -> None:
    for name in EAGLE3:
        packed, _ = eagle3_twins(run)
        outputs = [objective(eagle3(name, backend, run), packed, None, False) for backend in ("flex", "sdpa")]
        assert_same(*outputs, backward=False)
    for name in BLOCK_DRAFTS:
        modules = [block_draft(name, backend, run) for backend in ("flex", "sdpa")]
        packed, _, anchors, _ = block_twins(modules[0], run)
        assert_same(*[objective(module, packed, anchors, False) for module in modules], backward=False)


def check_live_slots_equal_every_slot_under_flex(run: Run) -> None:
    packed, _ = eagle3_twins(run)
    # Prompts of 3 tokens (dead slots at every step) and a hole, in each document.
    starts = [0, *torch.tensor(run.long_docs).cumsum(0)[:-1].tolist()]
    for start in starts:
        packed["loss_mask"][0, start : start + 3] = 0
    packed["loss_mask"][0, starts[1] + 5] = 0
    for name in EAGLE3:
        live = eagle3(name, "flex", run)
        every = eagle3(name, "flex", run, ttt_live_slots_only=False)
        every.load_state_dict(live.state_dict())
        run.numbers[name] = assert_same(
            objective(live, packed, None, run.cuda), objective(every, packed, None, run.cuda), run.cuda
        )


def check_flash_varlen_target_equals_sdpa(run: Run) -> None:
    run.need_cuda("flash-attn")
    if not flash_attn_available():
        raise Skipped("flash-attn is not installed")
    lengths = [700, 517, 303, 528]
    rows = [packed_row(random_docs(lengths, seed=1), 2048), packed_row(random_docs([1000, 37], seed=2), 2048)]
    batch = validate_batch(on(stack_rows(rows), run.device))
    real = batch.attention_mask.bool()
    for family in FAMILIES:
        config = {**TINY_TARGETS[family], "max_position_embeddings": 4096}
        outputs = {}
        for backend in ("flash", "sdpa"):
            target = FrozenTarget(config, attn_backend=backend, dtype="bfloat16").to(run.device)
            outputs[backend] = target(batch, [0, 3, 6])
        states = {
            backend: [*(h[real].float() for h in out.hidden_states), out.last_hidden_state[real].float()]
            for backend, out in outputs.items()
        }
        worst = 0.0
        for index, (flash, sdpa) in enumerate(zip(states["flash"], states["sdpa"], strict=True)):
            torch.testing.assert_close(flash, sdpa, rtol=2e-2, atol=2e-2, msg=f"{family} state {index}")
            worst = max(worst, (flash - sdpa).abs().max().item())
        run.numbers[family] = worst


def fit_updates(module: L.LightningModule, loader, precision: str, run: Run, steps: int):
    before = {n: p.detach().float().clone() for n, p in module.named_parameters() if p.requires_grad}
    losses = LossTrace()
    trainer = L.Trainer(
        accelerator="gpu" if run.cuda else "cpu",
        devices=1,
        max_steps=steps,
        precision=precision,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[losses],
    )
    trainer.fit(module, loader)
    after = dict(module.named_parameters())
    return {n: after[n].detach().float().cpu() - w.cpu() for n, w in before.items()}, losses.values


class LossTrace(L.Callback):
    def __init__(self) -> None:
        self.values: list[float] = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        self.values.append(float(outputs["loss"]))


def check_bf16_mixed_follows_float32(run: Run) -> None:
    steps = 5 if run.quick else 20
    eagle_rows = [stack_rows([packed_row(random_docs([9, 13, 10], seed=i), 32)]) for i in range(steps)]
    block_rows = [twins([[9, 6, 3], [11, 7]], width=20, seed=i)[0] for i in range(steps)]
    builds = {
        "eagle3": (
            lambda: Eagle3Module(TINY_TARGETS["llama"], ttt_length=2, learning_rate=2e-4, warmup_ratio=0.0),
            eagle_rows,
        ),
        "dflash": (
            lambda: DFlashModule(
                TINY_TARGETS["qwen3"],
                mask_token_id=MASK_TOKEN,
                num_draft_layers=2,
                block_size=BLOCK,
                num_anchors=3,
                learning_rate=2e-4,
                warmup_ratio=0.0,
            ),
            block_rows,
        ),
    }
    for name, (build, rows) in builds.items():
        data = [{k: v[0] for k, v in r.items()} for r in rows] if name == "eagle3" else rows
        loader = torch.utils.data.DataLoader(data, batch_size=None if name != "eagle3" else 1)
        results = {}
        for precision in ("32-true", "bf16-mixed"):
            L.seed_everything(0)
            results[precision] = fit_updates(build(), loader, precision, run, steps)
        (reference, ref_losses), (mixed, losses) = results["32-true"], results["bf16-mixed"]
        unmoved = [n for n, d in mixed.items() if d.abs().max() == 0]
        assert not unmoved, f"{name}: bf16-mixed left {unmoved[:3]} unmoved"
        loss_gap = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses, strict=True))
        gains = [n for n in reference if n.endswith("norm.weight")]
        # Mean absolute difference of the updates over the float32 run's mean update (an element whose
        # float32 gradient is near zero can step either way in AdamW's first steps).
        gain_error = max(
            float((mixed[n] - reference[n]).abs().mean() / reference[n].abs().mean()) for n in gains
        )
        run.numbers[name] = {"max_relative_loss_gap": loss_gap, "norm_gain_update_error": gain_error}
        assert loss_gap < 0.02, f"{name}: loss {losses} vs float32 {ref_losses}"
        assert gain_error < 0.25, f"{name}: norm gains' updates off the float32 run's by {gain_error:.3f}"


def check_one_gpu_fit_with_fsdp1_and_fsdp2(run: Run) -> None:
    run.need_cuda("FSDPStrategy / ModelParallelStrategy on one GPU")
    from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    rows = [stack_rows([packed_row(random_docs([9, 13, 10], seed=i), 32)]) for i in range(6)]
    loader = torch.utils.data.DataLoader([{k: v[0] for k, v in r.items()} for r in rows], batch_size=1)
    strategies = {
        "fsdp1": lambda: FSDPStrategy(auto_wrap_policy={LlamaDecoderLayer}, state_dict_type="full"),
        "fsdp2": lambda: ModelParallelStrategy(
            data_parallel_size=1, tensor_parallel_size=1, save_distributed_checkpoint=False
        ),
    }
    with tempfile.TemporaryDirectory() as scratch:
        for name, strategy in strategies.items():
            checkpoint = Path(scratch) / f"{name}.ckpt"
            for phase, steps in (("train", 3), ("resume", 5)):
                module = Eagle3Module(TINY_TARGETS["llama"], ttt_length=2, shard_target=name == "fsdp2")
                trainer = L.Trainer(
                    accelerator="gpu",
                    devices=1,
                    strategy=strategy(),
                    precision="bf16-mixed",
                    gradient_clip_val=1.0,
                    max_steps=steps,
                    logger=False,
                    enable_checkpointing=False,
                    enable_progress_bar=False,
                    enable_model_summary=False,
                )
                trainer.fit(module, loader, ckpt_path=checkpoint if phase == "resume" else None)
                assert trainer.global_step == steps, (name, phase, trainer.global_step)
                if phase == "train":
                    trainer.save_checkpoint(checkpoint)
            saved = torch.load(checkpoint, weights_only=False)["state_dict"]
            target_keys = [k for k in saved if k.startswith("target.")]
            assert saved and not target_keys, (name, target_keys[:3])
            run.numbers[name] = {"checkpoint_keys": len(saved), "resumed_to_step": 5}


def check_throughput_packed_vs_padded(run: Run) -> None:
    run.need_cuda("benchmarks/throughput.py --device cuda")
    command = [
        sys.executable, str(ROOT / "benchmarks" / "throughput.py"), "--device", "cuda",
        "--drafts", "eagle3", "dflash", "--documents", "32", "--repeats", "1", "--max-tokens", "2048",
    ]  # fmt: skip
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    run.numbers["stdout_tail"] = proc.stdout[-4000:]
    assert proc.returncode == 0, proc.stderr[-4000:]


CHECKS: list[Callable[[Run], None]] = [
    check_auto_resolves_as_documented,
    check_rope_tables_stay_float32,
    check_flex_kernel_equals_sdpa,
    check_packed_equals_padded_under_flex,
    check_flex_equals_sdpa_for_every_draft,
    check_live_slots_equal_every_slot_under_flex,
    check_flash_varlen_target_equals_sdpa,
    check_bf16_mixed_follows_float32,
    check_one_gpu_fit_with_fsdp1_and_fsdp2,
    check_throughput_packed_vs_padded,
]


def environment(device: str) -> dict:
    versions = {}
    for package in ("torch", "triton", "flash-attn", "transformers", "lightning"):
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = None
    name = torch.cuda.get_device_name() if device == "cuda" else platform.processor() or platform.machine()
    return {
        "versions": versions,
        "device": device,
        "device_name": name,
        "python": platform.python_version(),
        "inductor_cache": os.environ["TORCHINDUCTOR_CACHE_DIR"],
    }


def write(path: Path, report: dict) -> None:
    staged = path.with_suffix(path.suffix + ".tmp")
    staged.write_text(json.dumps(report, indent=2, default=str))
    staged.replace(path)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")) / "gpu_paths.json")
    parser.add_argument("--budget", type=float, default=450.0, help="seconds; later checks are skipped")
    parser.add_argument("--quick", action="store_true", help="short rows and few steps (the CPU suite's run)")
    parser.add_argument("--checks", nargs="+", help="run only these checks (names without 'check_')")
    args = parser.parse_args()
    # A recompile-limit hit means flex ran unfused from then on: fail the check, do not hide it.
    torch._dynamo.config.fail_on_recompile_limit_hit = True
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report = {"environment": environment(args.device), "budget_s": args.budget, "checks": []}
    start = time.monotonic()
    failures = 0
    for check in CHECKS:
        name = check.__name__.removeprefix("check_")
        if args.checks and name not in args.checks:
            continue
        run = Run(args.device, args.quick)
        began = time.monotonic()
        result: dict = {"check": name}
        if began - start > args.budget:
            result.update(status="SKIP", reason=f"time budget of {args.budget:.0f} s spent")
        else:
            try:
                check(run)
                result["status"] = "PASS"
            except Skipped as reason:
                result.update(status="SKIP", reason=str(reason))
            except Exception:  # every failure is reported, then the next check runs
                failures += 1
                result.update(status="FAIL", error=traceback.format_exc()[-6000:])
        result.update(numbers=run.numbers, seconds=round(time.monotonic() - began, 2))
        report["checks"].append(result)
        report["seconds"] = round(time.monotonic() - start, 2)
        write(args.out, report)
        print(f"{result['status']} {name} ({result['seconds']} s) {result.get('reason', '')}", flush=True)
        if result["status"] == "FAIL":
            print(result["error"], flush=True)
    return failures


if __name__ == "__main__":
    sys.exit(main())
