"""The frozen target's rotary tables (``inv_freq``, ``original_inv_freq``) stay float32 whatever casts the
module: ``target_dtype``, ``.to(bfloat16)``, Lightning's ``bf16-true`` ``convert_module`` (single device and
FSDP1), FSDP1's in-place buffer cast. vLLM and ``from_pretrained(dtype=bfloat16)`` keep them float32, so the
teacher's features must be the ones a bf16 model with float32 tables computes, at long positions too."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch.plugins.precision import FSDPPrecision, HalfPrecision
from transformers import LlamaConfig, LlamaForCausalLM

from lightning_drafts.attention.backends import block_causal_mask
from lightning_drafts.core.batch import validate_batch
from lightning_drafts.training.target import ROPE_TABLES, FrozenTarget, build_causal_lm
from tests.support.builders import TINY_TARGETS, packed_row, random_docs

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


def router_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The tensors DeepSeek-V3's class declares float32 whatever the load dtype (its router weight and score
    correction bias), read from transformers' own declaration."""
    declared = type(model)._keep_in_fp32_modules_strict
    named = [*model.named_parameters(), *model.named_buffers()]
    return {name: tensor for name, tensor in named if any(name.endswith(f".{piece}") for piece in declared)}


def test_the_moe_router_stays_float32_in_a_bf16_target():
    """A bf16 DeepSeek-V3 target keeps the router transformers keeps float32 (``from_pretrained(dtype=bf16)``
    and vLLM do): through the target's own cast and every later one, at the float32 build's exact values, so
    expert choice at near-ties is the served target's."""
    reference = router_tensors(FrozenTarget(TINY_TARGETS["deepseek_v3"], dtype="float32").model)
    assert reference and {n.rsplit(".", 1)[-1] for n in reference} == {"weight", "e_score_correction_bias"}
    casts = {
        "built": lambda target: target,
        "to(bfloat16)": lambda target: target.to(torch.bfloat16),
        "bf16-true": lambda target: HalfPrecision("bf16-true").convert_module(target),
    }
    for name, cast in casts.items():
        router = router_tensors(cast(FrozenTarget(TINY_TARGETS["deepseek_v3"], dtype="bfloat16")).model)
        assert router.keys() == reference.keys(), name
        for key, tensor in router.items():
            assert tensor.dtype == torch.float32, (name, key)
            assert torch.equal(tensor, reference[key]), (name, key)


class NormsKeptInFloat16(LlamaForCausalLM):
    """A Llama whose norms transformers keeps float32 in a float16 model only, as gpt-oss's class declares."""

    _keep_in_fp32_modules = ["input_layernorm", "post_attention_layernorm", "norm"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_tensors_kept_float32_only_in_float16_follow_from_pretrained(tmp_path, dtype):
    """``_keep_in_fp32_modules`` (not ``_strict``) keeps tensors float32 in a float16 load only: the target's
    dtypes and values are those ``from_pretrained(dtype=...)`` gives the same checkpoint."""
    torch.manual_seed(0)
    model = NormsKeptInFloat16(LlamaConfig(**{**TINY_TARGETS["llama"], "num_hidden_layers": 2}))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name:  # gains that bf16 / fp16 cannot hold exactly
                parameter.add_(torch.rand_like(parameter) * 1e-3)
    model.save_pretrained(tmp_path)
    reference = dict(NormsKeptInFloat16.from_pretrained(tmp_path, dtype=dtype).named_parameters())
    ours = dict(FrozenTarget(model, dtype=dtype).model.named_parameters())
    assert ours.keys() == reference.keys()
    kept = {name for name, tensor in reference.items() if tensor.dtype == torch.float32}
    assert bool(kept) == (dtype == torch.float16) and all("norm" in name for name in kept), kept
    for name, tensor in reference.items():
        assert ours[name].dtype == tensor.dtype and torch.equal(ours[name], tensor), name


def draft_tables(module: torch.nn.Module) -> list[torch.Tensor]:
    return [buffer for name, buffer in module.draft.named_buffers() if name.endswith("inv_freq")]


@pytest.mark.parametrize("family", ["eagle3", "dflash"])
def test_the_drafts_rope_tables_undo_an_in_place_buffer_cast(family):
    """FSDP1's ``bf16-mixed`` casts every buffer to bf16 with ``buffer.data = ...`` at its lazy init, past the
    drafts' ``_apply``: the draft must still rotate with its float32 table (the one vLLM serves with), so its
    loss equals that of a draft never cast, exactly (everything else is float32 here)."""
    from lightning_drafts import DFlashModule, Eagle3Module
    from tests.support.block_draft_cases import BLOCK, MASK_TOKEN, twins
    from tests.support.eagle3_checks import frequencies

    def build():
        torch.manual_seed(0)
        if family == "eagle3":
            target = {**TINY_TARGETS["llama"], "max_position_embeddings": LONG}
            module = Eagle3Module(target, ttt_length=2, draft_vocab_size=48, token_frequencies=frequencies())
            return module, packed_row(random_docs([900, 40], seed=1), 940), None
        target = {**TINY_TARGETS["qwen3"], "max_position_embeddings": LONG}
        module = DFlashModule(target, mask_token_id=MASK_TOKEN, num_draft_layers=2, block_size=BLOCK)
        batch = twins([[900, 40]], width=940)[0]
        anchors = module.sample_anchors(validate_batch(batch), generator=torch.Generator().manual_seed(0))
        return module, batch, anchors

    def loss(module, batch, anchors):
        with torch.no_grad():
            output = (
                module.compute_loss(batch) if anchors is None else module.compute_loss(batch, anchors=anchors)
            )
        return output.loss

    module, batch, anchors = build()
    reference = loss(module, batch, anchors)
    cast, _, _ = build()
    assert draft_tables(cast)
    for buffer in draft_tables(cast):
        buffer.data = buffer.to(torch.bfloat16)
    assert torch.equal(loss(cast, batch, anchors), reference)
    assert all(table.dtype == torch.float32 for table in draft_tables(cast))
