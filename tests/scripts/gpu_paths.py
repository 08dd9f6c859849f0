"""The GPU paths, checked on a CUDA machine (the CPU suite cannot run them; run when a GPU is lent):

    python tests/scripts/gpu_paths.py            # on CUDA: every check below
    python tests/scripts/gpu_paths.py --device cpu   # a dry run of the script itself (flex forward only)

1. packed == padded with the flex ``BlockMask`` target and draft (fp32): loss, every draft gradient
   and the chains, for EAGLE-3, MLA-EAGLE-3, DFlash, DFlash2 and DSpark (CPU dry run: loss only, since
   flex has no CPU backward);
2. flex == SDPA on the same packed batch (loss and chains);
3. EAGLE-3 / MLA-EAGLE-3 at live TTT slots only (the default) == every slot at every step, under flex
   (loss, every draft gradient, the chains; CPU dry run: loss only);
4. the flash-attn varlen target gives the SDPA target's captured layers (flash-attn installed only);
5. one bf16 optimizer step of each draft on a packed batch is finite.

Each check prints PASS / FAIL with its error; the exit code is the number of failures.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lightning_drafts import (  # noqa: E402
    DFlash2Module,
    DFlashModule,
    DSparkModule,
    Eagle3Module,
    MLAEagle3Module,
)
from lightning_drafts.core.batch import validate_batch  # noqa: E402
from tests.block_draft_cases import BLOCK, MASK_TOKEN, ROWS, perturb, to_padded, twins  # noqa: E402
from tests.builders import TINY_TARGETS, packed_row, padded_rows, random_docs  # noqa: E402
from tests.eagle3_checks import frequencies  # noqa: E402

EAGLE3 = {"eagle3": (Eagle3Module, "llama"), "mla_eagle3": (MLAEagle3Module, "deepseek_v3")}
BLOCK_DRAFTS = {"dflash": DFlashModule, "dflash2": DFlash2Module, "dspark": DSparkModule}
BLOCK_SIZES = {"dflash2": {"conv_group_size": 4, "selector_rank": 8, "selector_top_k": 4}}


class Skipped(Exception):
    """A check that cannot run on this machine (reported, not counted as a failure)."""


def on(batch: dict, device: str) -> dict:
    return {key: value.to(device) for key, value in batch.items()}


def eagle3(name: str, backend: str, device: str, **options) -> torch.nn.Module:
    module_class, family = EAGLE3[name]
    torch.manual_seed(0)
    module = module_class(
        TINY_TARGETS[family],
        ttt_length=3,
        draft_vocab_size=48,
        token_frequencies=frequencies(),
        target_attn_backend=backend,
        draft_attn_backend=backend,
        **options,
    )
    return module.to(device)


def block_draft(name: str, backend: str, device: str) -> torch.nn.Module:
    torch.manual_seed(0)
    module = BLOCK_DRAFTS[name](
        TINY_TARGETS["qwen3"],
        mask_token_id=MASK_TOKEN,
        num_draft_layers=2,
        block_size=BLOCK,
        num_anchors=3,
        target_attn_backend=backend,
        draft_attn_backend=backend,
        logits_chunk_blocks=2,  # several chunks: gradients taken in forward, on the GPU too
        **BLOCK_SIZES.get(name, {}),
    )
    perturb(module)
    return module.to(device)


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


def assert_same(first, second, backward: bool) -> None:
    (a, grads_a), (b, grads_b) = first, second
    torch.testing.assert_close(a.loss, b.loss, rtol=1e-5, atol=1e-6)
    assert torch.equal(a.valid.cpu(), b.valid.cpu()) and torch.equal(a.correct.cpu(), b.correct.cpu())
    if backward:
        assert grads_a.keys() == grads_b.keys() and grads_a, "no gradients"
        for name, grad in grads_b.items():
            scale = max(grad.abs().max().item(), 1e-6)
            torch.testing.assert_close(grads_a[name], grad, rtol=1e-4, atol=1e-5 * scale, msg=name)


def eagle3_twins(device: str) -> tuple[dict, dict]:
    docs = random_docs([7, 5, 9, 4], seed=1)
    return on(packed_row(docs, 28), device), on(padded_rows(docs, 9), device)


def block_twins(module: torch.nn.Module, device: str) -> tuple[dict, dict, torch.Tensor, torch.Tensor]:
    """The packed / padded twins and the same anchors in both, drawn by the module's own sampler (DSpark's
    rules differ from DFlash's)."""
    packed_batch, padded_batch = twins(ROWS, width=20)
    packed = validate_batch(packed_batch)
    anchors = module.sample_anchors(packed, generator=torch.Generator().manual_seed(0)).cpu()
    padded_anchors, _ = to_padded(packed, anchors)
    return on(packed_batch, device), on(padded_batch, device), anchors.to(device), padded_anchors.to(device)


def check_packed_equals_padded_under_flex(device: str) -> None:
    backward = device == "cuda"
    for name in EAGLE3:
        module = eagle3(name, "flex", device)
        packed, padded = eagle3_twins(device)
        assert_same(
            objective(module, packed, None, backward), objective(module, padded, None, backward), backward
        )
    for name in BLOCK_DRAFTS:
        module = block_draft(name, "flex", device)
        packed, padded, anchors, padded_anchors = block_twins(module, device)
        assert_same(
            objective(module, packed, anchors, backward),
            objective(module, padded, padded_anchors, backward),
            backward,
        )


def check_flex_equals_sdpa(device: str) -> None:
    for name in EAGLE3:
        packed, _ = eagle3_twins(device)
        outputs = [
            objective(eagle3(name, backend, device), packed, None, False) for backend in ("flex", "sdpa")
        ]
        assert_same(*outputs, backward=False)
    for name in BLOCK_DRAFTS:
        modules = [block_draft(name, backend, device) for backend in ("flex", "sdpa")]
        packed, _, anchors, _ = block_twins(modules[0], device)
        outputs = [objective(module, packed, anchors, False) for module in modules]
        assert_same(*outputs, backward=False)


def check_live_slots_equal_every_slot_under_flex(device: str) -> None:
    backward = device == "cuda"
    packed, _ = eagle3_twins(device)
    # Prompts of 3 tokens (dead slots at every step) and a hole, in each of the four documents.
    for start in (0, 7, 12, 21):
        packed["loss_mask"][0, start : start + 3] = 0
    packed["loss_mask"][0, 17] = 0
    for name in EAGLE3:
        live = eagle3(name, "flex", device)
        every = eagle3(name, "flex", device, ttt_live_slots_only=False)
        every.load_state_dict(live.state_dict())
        assert_same(
            objective(live, packed, None, backward), objective(every, packed, None, backward), backward
        )


def check_flash_varlen_target_equals_sdpa(device: str) -> None:
    if device != "cuda" or importlib.util.find_spec("flash_attn") is None:
        raise Skipped("needs CUDA and flash-attn")
    packed, _ = eagle3_twins(device)
    captured = {}
    for backend in ("flash", "sdpa"):
        module = eagle3("eagle3", backend, device).to(torch.bfloat16)
        batch = module.prepare_batch(packed)
        with torch.no_grad():
            output = module.target(batch, module.target_layer_ids)
        real = batch.attention_mask
        captured[backend] = [state[real].float() for state in output.hidden_states]
    for flash, sdpa in zip(captured["flash"], captured["sdpa"], strict=True):
        torch.testing.assert_close(flash, sdpa, rtol=2e-2, atol=2e-2)


def block_step_inputs(module: torch.nn.Module, device: str) -> tuple[torch.nn.Module, dict, torch.Tensor]:
    packed, _, anchors, _ = block_twins(module, device)
    return module, packed, anchors


def check_bf16_step_is_finite(device: str) -> None:
    if device != "cuda":
        raise Skipped("bf16 training is checked on CUDA")
    builders: dict[str, Callable[[], tuple]] = {
        **{n: lambda n=n: (eagle3(n, "auto", device), eagle3_twins(device)[0], None) for n in EAGLE3},
        **{n: lambda n=n: block_step_inputs(block_draft(n, "auto", device), device) for n in BLOCK_DRAFTS},
    }
    for name, build in builders.items():
        module, batch, anchors = build()
        module = module.to(torch.bfloat16)
        optimizer = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=1e-4)
        output, _ = objective(module, batch, anchors, True)
        optimizer.step()
        assert torch.isfinite(output.loss.float()), f"{name}: loss {output.loss}"
        bad = [n for n, p in module.draft.named_parameters() if not torch.isfinite(p.float()).all()]
        assert not bad, f"{name}: non-finite weights after a step: {bad[:3]}"


CHECKS = [
    check_packed_equals_padded_under_flex,
    check_flex_equals_sdpa,
    check_live_slots_equal_every_slot_under_flex,
    check_flash_varlen_target_equals_sdpa,
    check_bf16_step_is_finite,
]


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    device = parser.parse_args().device
    failures = 0
    for check in CHECKS:
        try:
            check(device)
            print(f"PASS {check.__name__} ({device})", flush=True)
        except Skipped as reason:
            print(f"SKIP {check.__name__}: {reason}", flush=True)
        except Exception:  # every failure is reported, then the next check runs
            failures += 1
            print(f"FAIL {check.__name__}:\n{traceback.format_exc()}", flush=True)
    return failures


if __name__ == "__main__":
    sys.exit(main())
