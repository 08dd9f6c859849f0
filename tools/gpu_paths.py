"""The GPU acceptance run: one GPU, under 8 minutes, the most informative and cheapest proofs first.

    python tools/gpu_paths.py                        # on CUDA: every check below
    python tools/gpu_paths.py --device cpu [--quick] # every check that has a CPU forward

Each check runs in a process of its own with a timeout of its own (``CHECK_TIMEOUT_S``; off CUDA a fork of
this process, which saves each check the imports): a fresh dynamo cache per check (no check inherits
another's compiled variants), and a hang or a crash of one check costs that check only. Results go to
``--out`` (default ``$OUT/gpu_paths.json``, else ``./gpu_paths.json``), rewritten after every check, so a run
cut off keeps what it proved: the versions (torch, triton, flash-attn, transformers, lightning), the device,
and per check PASS / FAIL / SKIP, its numbers (with the compiled attention variants it left, per entry point)
and its seconds. A check that would start after ``--budget`` seconds is skipped (the time guard). Inductor's
cache lives in a persistent directory (``TORCHINDUCTOR_CACHE_DIR``, default ``.cache/inductor`` in the
repository), so a second run compiles nothing; a dynamo recompile-limit hit fails the check that hit it
instead of silently running flex unfused.

Checks, in the order they run:

1. ``auto`` resolves as documented: flash-attn varlen target where flash-attn imports and matches this
   torch, else flex, on CUDA (SDPA on a CPU); block drafts: flex on CUDA;
2. the frozen target's rope tables, and the tensors transformers keeps float32 (DeepSeek-V3's router),
   stay float32 in a bf16 target after the bf16-true cast, on the device;
3. the fused target (flash-attn varlen where installed, else flex) == the SDPA target in bf16 for a Llama, a
   Qwen3 and a DeepSeek-V3 target: every captured layer and the final-norm state, at real tokens, within a
   bound a one-document leak exceeds (on a CPU: the flex target);
4. targets with other layer kinds (Gemma 3 and Mistral sliding windows, Llama 4 chunks, gpt-oss windows
   with attention sinks), packed: flex (one block mask per layer kind) and flash-attn varlen (where
   installed) == eager attention with the same per-document masks in bf16, every captured layer and the
   final state within the bound of check 3; gpt-oss refused by flash-attn varlen, and by flex on a CPU;
   a Qwen3-Next target (Gated DeltaNet linear attention) on flash-attn (where installed) and SDPA == the
   model's own forward of each document alone, flex refused;
5. ``bf16-mixed`` vs float32 over 20 optimizer steps through Lightning (EAGLE-3 and DFlash): the loss
   stays close and every trainable weight moved, the RMSNorm gains included;
6. a 1-GPU ``fit`` with ``FSDPStrategy`` (FSDP1, bf16-mixed, clipping by norm) and with
   ``ModelParallelStrategy`` (FSDP2, ``shard_target``): a few steps, the drafts' rope tables still float32,
   a checkpoint without target weights, and a resumed run (CUDA only);
7. flex == SDPA at the kernel: the drafts' compiled entry points (with and without the log-sum-exp) on a
   packed multi-document mask over 2,048 tokens, outputs, log-sum-exp and gradients (CPU: forward only,
   no log-sum-exp: CPU inductor compiles neither);
8. packed == padded under flex for every draft over rows of 2,048 tokens (multi-block masks, partial
   blocks at document edges, DFlash's sliding-window block mask): loss, every draft gradient, the
   chains (CPU: loss and chains);
9. flex == SDPA for every draft on the same packed batch (loss and chains);
10. EAGLE-3 / MLA-EAGLE-3 at live TTT slots only == every slot at every step, under flex;
11. real shapes: a Llama-3.1-8B-wide target (hidden 4,096, 32 / 8 heads of 128, a 128,256-id vocabulary,
    8 layers) in bf16 and one ``bf16-mixed`` training micro-batch of EAGLE-3 and of DFlash over a packed
    8,192-token row under flex: finite loss and gradients, the step's seconds and peak memory (CUDA only);
12. ``benchmarks/throughput.py --device cuda``: packed vs padded tokens per second and peak memory
    (CUDA only).

The exit code is the number of failed checks.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import multiprocessing
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
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
    compiled_variants,
    document_causal_mask_mod,
    flash_attn_available,
    flex_attention_for,
    mask_kind,
    resolve_backend,
)
from lightning_drafts.attention.block_masks import resolve_block_backend  # noqa: E402
from lightning_drafts.core.batch import PackedBatch, validate_batch  # noqa: E402
from lightning_drafts.training.target import ROPE_TABLES, FrozenTarget  # noqa: E402
from lightning_drafts.workflows.memory_plan import plan_config  # noqa: E402
from tests.support.block_draft_cases import BLOCK, MASK_TOKEN, perturb, to_padded, twins  # noqa: E402
from tests.support.builders import TINY_TARGETS, packed_row, padded_rows, random_docs, stack_rows  # noqa: E402
from tests.support.eagle3_checks import frequencies  # noqa: E402
from tests.support.target_matrix import config as matrix_config  # noqa: E402

EAGLE3 = {"eagle3": (Eagle3Module, "llama"), "mla_eagle3": (MLAEagle3Module, "deepseek_v3")}
BLOCK_DRAFTS = {
    "dflash": (DFlashModule, {}),
    "dflash_window": (DFlashModule, {"sliding_window": 96}),
    "dflash2": (DFlash2Module, {"conv_group_size": 4, "selector_rank": 8, "selector_top_k": 4}),
    "dspark": (DSparkModule, {}),
}
FAMILIES = ("llama", "qwen3", "deepseek_v3")
# CUDA flex (inductor's Triton kernel) needs query, key and value heads of at least 16 dims: the tiny targets'
# heads of 8 widened to 16 (on a CPU too, so the dry run computes what the GPU run does).
WIDE_HEADS = {"llama": {"head_dim": 16}, "qwen3": {"head_dim": 16}, "deepseek_v3": {"v_head_dim": 16}}


def tiny(family: str) -> dict:
    """The tiny ``family`` target with heads CUDA flex runs and room for 4,096 positions."""
    return {**TINY_TARGETS[family], "max_position_embeddings": 4096, **WIDE_HEADS[family]}


# The checks that run on CUDA only, with what they run: on another device the parent reports them SKIP
# without spending a process on each.
CUDA_ONLY = {
    "one_gpu_fit_with_fsdp1_and_fsdp2": "FSDPStrategy / ModelParallelStrategy on one GPU",
    "real_shapes_step": "a Llama-3.1-8B-wide micro-batch",
    "throughput_packed_vs_padded": "benchmarks/throughput.py --device cuda",
}


def cuda_only_reason(check: str) -> str:
    return f"{CUDA_ONLY[check]} runs on CUDA only"


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

    def need_cuda(self, check: str) -> None:
        if not self.cuda:
            raise Skipped(cuda_only_reason(check))


def on(batch: dict, device: str) -> dict:
    return {key: value.to(device) for key, value in batch.items()}


def eagle3(name: str, backend: str, run: Run, **options) -> torch.nn.Module:
    module_class, family = EAGLE3[name]
    torch.manual_seed(0)
    module = module_class(
        tiny(family),
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
        tiny("qwen3"),
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
        target = FrozenTarget(tiny(family), dtype="bfloat16")
        target = HalfPrecision("bf16-true").convert_module(target.to(run.device))
        tables = {n: b for n, b in target.model.named_buffers() if n.rsplit(".", 1)[-1] in ROPE_TABLES}
        assert tables, family
        # What the transformers release in use declares float32 (5.25: DeepSeek-V3's router weight and score
        # bias; 5.17: the bias only), read from the model class.
        declared = type(target.model)._keep_in_fp32_modules_strict or ()
        named = [*target.model.named_parameters(), *target.model.named_buffers()]
        kept = {n: t for n, t in named if any(n.endswith(f".{piece}") for piece in declared)}
        assert bool(kept) == (family == "deepseek_v3"), (family, list(kept)[:3])
        wrong = {n: str(b.dtype) for n, b in {**tables, **kept}.items() if b.dtype != torch.float32}
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
    kind = mask_kind(mask.mask_mod)
    flex = flex_attention_for(torch.device(run.device)) if run.quick else compiled_flex_attention(False, kind)
    with torch.no_grad():
        out = flex(q, k, v, mask, scale)
        reference = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=dense, scale=scale)
    torch.testing.assert_close(out, reference, rtol=2e-5, atol=2e-5)
    run.numbers["max_abs_diff_out"] = (out - reference).abs().max().item()
    if not run.cuda:
        return
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out, lse = compiled_flex_attention(True, kind)(*leaves, mask, scale)
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


def state_gap(fused: torch.Tensor, reference: torch.Tensor) -> float:
    """``||fused - reference|| / ||reference||`` over one state: bf16 kernels that sum in other orders differ
    by a few bf16 ulps per element (2^-8 relative each, a few layers deep), about 1e-2 of the state's norm at
    most; a document that sees another's keys changes its tokens' states by a fraction of their norm."""
    return float((fused - reference).norm() / reference.norm())


# 2^-5: eight bf16 ulps of the state's norm. Measured on a CPU over the tiny targets' 8 layers, flex vs SDPA
# in bf16: 1.5e-3 at layer 0 to 7.6e-3 at the final norm; with document 1 let see document 0 in the
# document mask: 0.17 to 0.47.
STATE_GAP_BOUND = 2**-5


def target_batch(run: Run) -> tuple[PackedBatch, torch.Tensor]:
    """Two packed rows for the target checks (four documents ending inside flex blocks; a document as long as
    two of the first row's beside a short one) and their real-token mask."""
    lengths = [7, 5, 9, 11] if run.quick else [700, 517, 303, 528]
    width = 40 if run.quick else 2048
    rows = [
        packed_row(random_docs(lengths, seed=1), width),
        packed_row(random_docs([lengths[0] + lengths[1], 3], seed=2), width),
    ]
    batch = validate_batch(on(stack_rows(rows), run.device))
    return batch, batch.attention_mask.bool()


def captured_states(output, real: torch.Tensor) -> list[torch.Tensor]:
    """A target output's captured layers and final state at the real tokens, in float32."""
    return [*(h[real].float() for h in output.hidden_states), output.last_hidden_state[real].float()]


def check_fused_target_equals_sdpa(run: Run) -> None:
    backend = ("flash" if flash_attn_available() else "flex") if run.cuda else "flex"
    run.numbers["backend"] = backend
    batch, real = target_batch(run)
    for family in FAMILIES:
        config = tiny(family)
        outputs = {}
        for name in (backend, "sdpa"):
            target = FrozenTarget(config, attn_backend=name, dtype="bfloat16").to(run.device)
            outputs[name] = target(batch, [0, 3, 6])
        states = {name: captured_states(out, real) for name, out in outputs.items()}
        gaps = [state_gap(f, r) for f, r in zip(states[backend], states["sdpa"], strict=True)]
        run.numbers[family] = gaps
        assert max(gaps) < STATE_GAP_BOUND, f"{family}: {backend} vs sdpa state gaps {gaps}"


# Targets whose layers attend in other patterns than full causal attention, each as its own transformers
# config class: sliding windows (Gemma 3 alternating, Mistral on every layer), Llama 4's chunks, gpt-oss's
# windows with attention sinks.
LAYER_KIND_TARGETS = ("gemma3", "mistral", "llama4", "gpt_oss")


def layer_kind_target(architecture: str, window: int) -> dict:
    """The target matrix's tiny ``architecture`` with heads CUDA flex runs, room for 4,096 positions, and a
    window (or chunk) of ``window`` tokens."""
    config = {**matrix_config(architecture), "head_dim": 16}
    config["max_position_embeddings"] = max(config["max_position_embeddings"], 4096)
    for key in ("sliding_window", "attention_chunk_size"):
        if key in config:
            config[key] = window
    return config


def check_layer_kind_targets_equal_eager(run: Run) -> None:
    """Windows, chunks and sinks, packed: the fused target paths (flex with one block mask per layer kind,
    flash-attn varlen with transformers' window per layer) against eager attention with the same per-document
    masks, in bf16, every captured layer and the final state at real tokens. gpt-oss's sinks run in flex on
    CUDA only and are refused by flash-attn varlen (checked by its message); on a CPU flex runs the others."""
    window = 4 if run.quick else 256
    batch, real = target_batch(run)
    fused = (["flash"] if run.cuda and flash_attn_available() else []) + ["flex"]
    for architecture in LAYER_KIND_TARGETS:
        # One target per fit in production: its mask kinds' compiled variants, not four targets' together,
        # are what must stay inside dynamo's recompile limit.
        torch._dynamo.reset()
        config = layer_kind_target(architecture, window)
        reference = FrozenTarget(config, attn_backend="eager", dtype="bfloat16").to(run.device)(
            batch, [0, 1, 2]
        )
        expected = captured_states(reference, real)
        for backend in fused:
            target = FrozenTarget(config, attn_backend=backend, dtype="bfloat16").to(run.device)
            refusal = {
                ("gpt_oss", "flash"): "attention sinks are dropped by flash-attn varlen",
                ("gpt_oss", "flex"): None
                if run.cuda
                else "attention sinks do not run in flex attention on the CPU",
            }.get((architecture, backend))
            if refusal is not None:
                try:
                    target(batch, [0, 1, 2])
                except ValueError as error:
                    assert refusal in str(error), f"{architecture} on {backend}: {error}"
                    run.numbers[f"{architecture}/{backend}"] = "refused"
                    continue
                raise AssertionError(f"{architecture} on {backend} ran; it must be refused ({refusal})")
            out = target(batch, [0, 1, 2])
            gaps = [state_gap(f, r) for f, r in zip(captured_states(out, real), expected, strict=True)]
            run.numbers[f"{architecture}/{backend}"] = gaps
            assert max(gaps) < STATE_GAP_BOUND, f"{architecture}: {backend} vs eager state gaps {gaps}"
    check_linear_attention_target_runs_each_document_alone(run)


def each_document_alone(target: FrozenTarget, batch: PackedBatch, layer_ids: list[int]) -> list[torch.Tensor]:
    """The target's transformers model run on every real document of ``batch`` by itself (no packing code, no
    mask): the outputs of ``layer_ids`` and the final state, in float32, in the order of the real tokens."""
    states: list[list[torch.Tensor]] = [[] for _ in range(len(layer_ids) + 1)]
    for row, lengths in enumerate(batch.seq_lens.tolist()):
        start = 0
        for length in lengths:
            # A row's last entry counts its padding too.
            span = slice(start, start + length)
            document = batch.input_ids[row, span][batch.attention_mask[row, span].bool()][None]
            start += length
            if document.numel() == 0:
                continue
            with torch.no_grad():
                hidden = target.model(
                    input_ids=document, output_hidden_states=True, use_cache=False
                ).hidden_states
            for slot, layer in enumerate(layer_ids):
                states[slot].append(hidden[layer + 1][0].float())
            states[-1].append(hidden[-1][0].float())
    return [torch.cat(parts) for parts in states]


# transformers' last hidden state is the final norm's output, not the last layer's: the first two layers and
# the final state are compared.
LINEAR_CHECK_LAYERS = [0, 1]
# 2^-6, per token (the largest relative gap of one token's state): a recurrent state carried into the next
# document moves that document's first tokens most and barely the norm of a whole row. Measured on a CPU in
# bf16, SDPA against each document alone: 0.0036 at most on --quick's rows, 0 on the 2,048-token rows; with
# the state carried across documents, 0.19 and 0.038-0.052.
TOKEN_GAP_BOUND = 2**-6


def token_gap(fused: torch.Tensor, reference: torch.Tensor) -> float:
    """The largest relative gap of one token's state ``[N, H]`` to the reference's."""
    return float(((fused - reference).norm(dim=-1) / reference.norm(dim=-1)).max())


def check_linear_attention_target_runs_each_document_alone(run: Run) -> None:
    """Qwen3-Next (Gated DeltaNet layers around a full-attention layer, MoE), packed: every path that runs it
    (flash-attn where installed, SDPA) gives each document the features the model computes for that document
    alone, in bf16, token by token, against the model's own forward of each document; transformers refuses
    it flex attention."""
    batch, real = target_batch(run)
    # No window or chunk in it: layer_kind_target only gives it CUDA-sized heads and 4,096 positions.
    config = {
        **layer_kind_target("qwen3_next", window=0),
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
    }
    backends = (["flash"] if run.cuda and flash_attn_available() else []) + ["sdpa"]
    for backend in backends:
        target = FrozenTarget(config, attn_backend=backend, dtype="bfloat16").to(run.device)
        expected = each_document_alone(target, batch, LINEAR_CHECK_LAYERS)
        gaps = [
            token_gap(f, r)
            for f, r in zip(captured_states(target(batch, LINEAR_CHECK_LAYERS), real), expected, strict=True)
        ]
        run.numbers[f"qwen3_next/{backend}"] = gaps
        assert max(gaps) < TOKEN_GAP_BOUND, f"qwen3_next: {backend} vs each document alone, token gaps {gaps}"
    try:
        FrozenTarget(config, attn_backend="flex", dtype="bfloat16").to(run.device)(batch, LINEAR_CHECK_LAYERS)
    except ValueError as error:
        assert "without 'flex_attention' attention" in str(error), f"qwen3_next on flex: {error}"
        run.numbers["qwen3_next/flex"] = "refused"
        return
    raise AssertionError("qwen3_next on flex ran; transformers has no flex attention for it")


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
            lambda: Eagle3Module(tiny("llama"), ttt_length=2, learning_rate=2e-4, warmup_ratio=0.0),
            eagle_rows,
        ),
        "dflash": (
            lambda: DFlashModule(
                tiny("qwen3"),
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
    run.need_cuda("one_gpu_fit_with_fsdp1_and_fsdp2")
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
                module = Eagle3Module(tiny("llama"), ttt_length=2, shard_target=name == "fsdp2")
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
                # FSDP1's bf16-mixed casts buffers in place; the draft's angles must still come from float32.
                tables = {n: str(b.dtype) for n, b in module.draft.named_buffers() if "inv_freq" in n}
                assert tables and set(tables.values()) == {"torch.float32"}, (name, phase, tables)
                if phase == "train":
                    trainer.save_checkpoint(checkpoint)
            saved = torch.load(checkpoint, weights_only=False)["state_dict"]
            target_keys = [k for k in saved if k.startswith("target.")]
            assert saved and not target_keys, (name, target_keys[:3])
            run.numbers[name] = {"checkpoint_keys": len(saved), "resumed_to_step": 5}


REAL_TARGET = {
    "model_type": "llama",
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 8,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 16384,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
}


# Check 9's drafts, as the memory plan reads them (token frequencies leave the draft's sizes as they are).
REAL_SHAPES_DRAFTS = {
    "eagle3": ("lightning_drafts.Eagle3Module", {"ttt_length": 4, "draft_vocab_size": 32000}),
    "dflash": (
        "lightning_drafts.DFlashModule",
        {
            "mask_token_id": REAL_TARGET["vocab_size"] - 1,
            "num_draft_layers": 2,
            "block_size": 16,
            "num_anchors": 256,
        },
    ),
}


def planned_step_bytes(name: str, lengths: list[int]) -> float:
    """``lightning-drafts plan``'s peak for check 9's step of draft ``name``: one packed row of documents of
    ``lengths`` tokens, every token supervised, the weights and gradients but no optimizer state (the check
    takes no optimizer step); for EAGLE-3 the draft vocabulary's share of the labels as its coverage."""
    class_path, init_args = REAL_SHAPES_DRAFTS[name]
    config = {"model": {"class_path": class_path, "init_args": {**init_args, "target_dtype": "bfloat16"}}}
    plan = plan_config(
        config,
        REAL_TARGET,
        devices=1,
        precision="bf16-mixed",
        rows=1,
        width=sum(lengths),
        document_tokens=sum(lengths) // len(lengths),
        supervised=1.0,
        coverage=32000 / REAL_TARGET["vocab_size"],
        cpu=False,
    )
    return plan.peak - plan.memory["AdamW moments (fp32)"]


def check_real_shapes_step(run: Run) -> None:
    run.need_cuda("real_shapes_step")
    lengths = [3000, 1500, 2100, 1592]
    docs = random_docs(lengths, vocab=REAL_TARGET["vocab_size"], seed=3)
    batch = on(stack_rows([packed_row(docs, sum(lengths))]), run.device)
    builds = {
        "eagle3": lambda: Eagle3Module(
            REAL_TARGET,
            ttt_length=4,
            draft_vocab_size=32000,
            token_frequencies=torch.arange(REAL_TARGET["vocab_size"], 0, -1),
            target_dtype="bfloat16",
        ),
        "dflash": lambda: DFlashModule(
            REAL_TARGET,
            mask_token_id=REAL_TARGET["vocab_size"] - 1,
            num_draft_layers=2,
            block_size=16,
            num_anchors=256,
            target_dtype="bfloat16",
        ),
    }
    for name, build in builds.items():
        torch.manual_seed(0)
        with torch.device(run.device):  # random weights drawn on the GPU: 2.8B of them take minutes on a CPU
            module = build()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        seconds = []
        for _ in range(2):  # the first step compiles; the second is the step's time
            began = time.monotonic()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                output = module.compute_loss(validate_batch(batch))
            output.loss.backward()
            torch.cuda.synchronize()
            seconds.append(time.monotonic() - began)
            grads = [p.grad for p in module.draft.parameters() if p.grad is not None]
            assert torch.isfinite(output.loss) and grads and all(torch.isfinite(g).all() for g in grads), name
            module.zero_grad(set_to_none=True)
        run.numbers[name] = {
            "loss": float(output.loss),
            "first_step_s": round(seconds[0], 2),
            "step_s": round(seconds[1], 3),
            "peak_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
            # The memory plan's estimate of the same step (docs/guides/memory-plan.md), beside the measure.
            "planned_peak_gib": round(planned_step_bytes(name, lengths) / 2**30, 2),
            "tokens": sum(lengths),
        }
        del module, output, grads


def check_throughput_packed_vs_padded(run: Run) -> None:
    run.need_cuda("throughput_packed_vs_padded")
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
    check_fused_target_equals_sdpa,
    check_layer_kind_targets_equal_eager,
    check_bf16_mixed_follows_float32,
    check_one_gpu_fit_with_fsdp1_and_fsdp2,
    check_flex_kernel_equals_sdpa,
    check_packed_equals_padded_under_flex,
    check_real_shapes_step,
    check_flex_equals_sdpa_for_every_draft,
    check_live_slots_equal_every_slot_under_flex,
    check_throughput_packed_vs_padded,
]
# Each check's own limit in seconds (its process is killed past it), sized for a cold inductor cache on one
# H200: the flex checks compile new Triton kernels for every mask kind and head layout.
CHECK_TIMEOUT_S = {
    "auto_resolves_as_documented": 60,
    "rope_tables_stay_float32": 60,
    "fused_target_equals_sdpa": 120,
    "layer_kind_targets_equal_eager": 150,
    "bf16_mixed_follows_float32": 120,
    "one_gpu_fit_with_fsdp1_and_fsdp2": 150,
    "flex_kernel_equals_sdpa": 120,
    "packed_equals_padded_under_flex": 240,
    "flex_equals_sdpa_for_every_draft": 180,
    "live_slots_equal_every_slot_under_flex": 150,
    "real_shapes_step": 180,
    "throughput_packed_vs_padded": 240,
}


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


def run_one(name: str, device: str, quick: bool) -> dict:
    """Run the check ``name`` in this process (the child's side)."""
    # A recompile-limit hit means flex ran unfused from then on: fail the check, do not hide it.
    torch._dynamo.config.fail_on_recompile_limit_hit = True
    check = {c.__name__.removeprefix("check_"): c for c in CHECKS}[name]
    run = Run(device, quick)
    result: dict = {"check": name}
    try:
        check(run)
        result["status"] = "PASS"
    except Skipped as reason:
        result.update(status="SKIP", reason=str(reason))
    except Exception:  # every failure is reported, then the next check runs
        result.update(status="FAIL", error=traceback.format_exc()[-6000:])
    run.numbers["compiled_variants"] = compiled_variants()
    result["numbers"] = run.numbers
    return result


def forked_child(name: str, args: argparse.Namespace, result_path: Path, timeout: float) -> dict | None:
    """Run the check ``name`` in a fork of this process (which has imported torch, Lightning and the library
    but run nothing on a device): a process of its own, with its own dynamo cache from the first call,
    without paying the imports again. Only off CUDA: a fork cannot use the CUDA context of a parent that
    initialised it (``environment()`` does, for the device's name). Returns None when the child left a
    result, else the failure."""
    child = multiprocessing.get_context("fork").Process(
        target=lambda: result_path.write_text(json.dumps(run_one(name, args.device, args.quick), default=str))
    )
    child.start()
    child.join(timeout)
    if child.is_alive():
        child.kill()
        child.join()
        return {"check": name, "status": "FAIL", "error": f"killed after its {timeout} s timeout"}
    if result_path.exists():
        return None
    return {
        "check": name,
        "status": "FAIL",
        "error": f"the check's process exited {child.exitcode} without a result",
    }


def run_in_child(name: str, args: argparse.Namespace) -> dict:
    """Run the check ``name`` in a process of its own, killed after its timeout."""
    timeout = CHECK_TIMEOUT_S[name] * (1 if args.device == "cuda" else 3)
    with tempfile.TemporaryDirectory() as scratch:
        result_path = Path(scratch) / "result.json"
        if args.device != "cuda":
            failure = forked_child(name, args, result_path, timeout)
            return failure or json.loads(result_path.read_text())
        command = [
            sys.executable, __file__, "--one", name, "--device", args.device, "--result", str(result_path),
            *(["--quick"] if args.quick else []),
        ]  # fmt: skip
        try:
            proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as expired:
            tail = (expired.stdout or b"")[-3000:]
            tail = tail.decode(errors="replace") if isinstance(tail, bytes) else tail
            return {
                "check": name,
                "status": "FAIL",
                "error": f"killed after its {timeout} s timeout",
                "tail": tail,
            }
        if result_path.exists():
            return json.loads(result_path.read_text())
        return {
            "check": name,
            "status": "FAIL",
            "error": f"the check's process exited {proc.returncode} without a result: {proc.stderr[-4000:]}",
        }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")) / "gpu_paths.json")
    parser.add_argument("--budget", type=float, default=450.0, help="seconds; later checks are skipped")
    parser.add_argument("--quick", action="store_true", help="short rows and few steps (the CPU suite's run)")
    parser.add_argument("--checks", nargs="+", help="run only these checks (names without 'check_')")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        args.result.write_text(json.dumps(run_one(args.one, args.device, args.quick), default=str))
        return 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report = {"environment": environment(args.device), "budget_s": args.budget, "checks": []}
    start = time.monotonic()
    failures = 0
    for check in CHECKS:
        name = check.__name__.removeprefix("check_")
        if args.checks and name not in args.checks:
            continue
        began = time.monotonic()
        if began - start > args.budget:
            result = {"check": name, "status": "SKIP", "reason": f"time budget of {args.budget:.0f} s spent"}
        elif args.device != "cuda" and name in CUDA_ONLY:
            result = {"check": name, "status": "SKIP", "reason": cuda_only_reason(name)}
        else:
            result = run_in_child(name, args)
        failures += result["status"] == "FAIL"
        result["seconds"] = round(time.monotonic() - began, 2)
        report["checks"].append(result)
        report["seconds"] = round(time.monotonic() - start, 2)
        write(args.out, report)
        print(f"{result['status']} {name} ({result['seconds']} s) {result.get('reason', '')}", flush=True)
        if result["status"] == "FAIL":
            print(result["error"], flush=True)
    return failures


if __name__ == "__main__":
    sys.exit(main())
