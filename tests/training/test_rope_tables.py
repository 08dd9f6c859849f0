"""The frozen target's rotary tables (``inv_freq``, ``original_inv_freq``) stay float32 whatever casts the
module: ``target_dtype``, ``.to(bfloat16)``, Lightning's ``bf16-true`` ``convert_module`` (single device and
FSDP1), FSDP1's in-place buffer cast. vLLM and ``from_pretrained(dtype=bfloat16)`` keep them float32, so the
teacher's features must be the ones a bf16 model with float32 tables computes, at long positions too."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch.plugins.precision import FSDPPrecision, HalfPrecision

from lightning_drafts.attention.backends import block_causal_mask
from lightning_drafts.core.batch import validate_batch
from lightning_drafts.training.target import ROPE_TABLES, FrozenTarget, build_causal_lm
from tests.builders import TINY_TARGETS, packed_row, random_docs

LONG = 4096


def long_config(family: str) -> dict:
    return {**TINY_TARGETS[family], "max_position_embeddings": LONG, "num_hidden_layers": 2}


def rope_buffers(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: buffer for name, buffer in module.named_buffers() if name.rsplit(".", 1)[-1] in ROPE_TABLES}


def float32_tables(family: str) -> dict[str, torch.Tensor]:
    return rope_buffers(FrozenTarget(long_config(family), dtype="float32").model)


@pytest.mark.parametrize("family", ["llama", "qwen3", "deepseek_v3"])
def test_rope_tables_stay_float32_under_every_target_dtype_and_precision_cast(family):
    reference = float32_tables(family)
    assert reference and all(t.dtype == torch.float32 for t in reference.values())
    casts = {
        "built": lambda target: target,
        "to(bfloat16)": lambda target: target.to(torch.bfloat16),
        "half()": lambda target: target.half(),
        "bf16-true": lambda target: HalfPrecision("bf16-true").convert_module(target),
        "fsdp1 bf16-true": lambda target: FSDPPrecision("bf16-true").convert_module(target),
    }
    for dtype in (None, "bfloat16", "float16"):
        for name, cast in casts.items():
            target = cast(FrozenTarget(long_config(family), dtype=dtype))
            tables = rope_buffers(target.model)
            assert tables.keys() == reference.keys(), (dtype, name)
            for key, table in tables.items():
                assert table.dtype == torch.float32, (family, dtype, name, key)
                torch.testing.assert_close(table, reference[key], rtol=0, atol=0, msg=f"{dtype} {name} {key}")


def test_an_in_place_buffer_cast_is_undone_before_the_forward():
    """FSDP1 casts buffers to its ``buffer_dtype`` with ``buffer.data = ...`` (no ``Module._apply``)."""
    target = FrozenTarget(long_config("llama"), dtype="bfloat16", attn_backend="sdpa")
    for buffer in rope_buffers(target.model).values():
        buffer.data = buffer.to(torch.bfloat16)
    target(validate_batch(packed_row(random_docs([6], seed=0), 6)))
    assert all(t.dtype == torch.float32 for t in rope_buffers(target.model).values())


def test_bf16_target_features_at_long_positions_are_those_of_float32_rope_tables():
    """In bf16 compute after Lightning's bf16-true cast, the captured features at positions ~4k equal those
    of the same bf16 weights with float32 rope tables (the model as ``from_config(dtype=bfloat16)`` builds
    it, as vLLM serves it), to float32 round-off of the final cast; rounding the tables to bf16 (the bug)
    moves them by two orders of magnitude more."""
    batch = validate_batch(packed_row(random_docs([LONG], seed=3), LONG))
    layer = 0  # HF hidden_states[-1] is the final-norm output, not the last layer's
    family = "llama"
    target = HalfPrecision("bf16-true").convert_module(
        FrozenTarget(long_config(family), dtype="bfloat16", attn_backend="sdpa")
    )
    ours = target(batch, [layer]).hidden_states[0][0, -64:].float()

    reference = build_causal_lm(long_config(family), dtype="bfloat16", seed=0)
    assert all(t.dtype == torch.float32 for t in rope_buffers(reference).values())

    def features(model) -> torch.Tensor:
        model.set_attn_implementation("sdpa")
        with torch.no_grad():
            out = model.model(
                input_ids=batch.input_ids,
                position_ids=batch.position_ids,
                attention_mask=block_causal_mask(batch.doc_ids),
                output_hidden_states=True,
                use_cache=False,
            )
        return out.hidden_states[layer + 1][0, -64:].float()

    expected = features(reference)
    torch.testing.assert_close(ours, expected, rtol=1e-6, atol=1e-7)
    rounded = reference.to(torch.bfloat16)  # a plain cast rounds the tables: the bug
    assert all(t.dtype == torch.bfloat16 for t in rope_buffers(rounded).values())
    # Features of ~2e-2 here; rounded tables move them by ~2e-4 (1%), a hundred times the tolerance above.
    drift = (features(rounded) - expected).abs().max()
    assert drift > 1e-5, drift
