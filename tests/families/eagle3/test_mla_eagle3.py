"""MLAEagle3Module (DeepSeek MLA draft) on a tiny random DeepSeek-V3 MLA + MoE target: what is MLA's own
(packed == padded, isolation, bad batches, the export round trip: tests/families/test_conformance.py)."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoConfig

from lightning_drafts import MLAEagle3Module
from lightning_drafts.eagle3.mla_draft import MLADraftConfig, build_mla_draft
from lightning_drafts.eagle3.rope import (
    deepseek_rope_table,
    default_inverse_frequencies,
    resolve_rope_theta,
    vllm_deepseek_rope_scaling,
)
from tests.support import eagle3_checks as checks
from tests.support.builders import TINY_TARGETS, packed_row, random_docs

DEEPSEEK = TINY_TARGETS["deepseek_v3"]


def test_doc_remaining_gate_worked_example():
    checks.check_gate_worked_example(MLAEagle3Module, DEEPSEEK)


def test_every_guard_raises_value_error():
    checks.check_guards(MLAEagle3Module, DEEPSEEK)


def test_a_dense_target_is_refused():
    with pytest.raises(ValueError, match="MLA fields"):
        MLAEagle3Module(TINY_TARGETS["llama"])


def test_loss_decreases_on_a_fixed_batch():
    checks.check_loss_decreases(MLAEagle3Module, DEEPSEEK)


def test_export_round_trips_into_mla_eagle3_module(tmp_path):
    exported = checks.check_export_round_trip(MLAEagle3Module, DEEPSEEK, tmp_path)
    config, weights = exported["config"], exported["weights"]
    # vLLM's DeepSeek MLA EAGLE-3 class; a deepseek_v3 model_type would make vLLM build its MTP model instead.
    assert (
        config["architectures"] == ["Eagle3DeepseekV2ForCausalLM"] and config["model_type"] == "deepseek_v2"
    )
    for field in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        assert config[field] == DEEPSEEK[field]
    assert config["rope_interleave"] is True and config["hidden_act"] == "silu"
    attention = {name.removeprefix("midlayer.self_attn.") for name in weights if "self_attn" in name}
    assert attention == {
        "q_a_proj.weight",
        "q_a_layernorm.weight",
        "q_b_proj.weight",
        "kv_a_proj_with_mqa.weight",
        "kv_a_layernorm.weight",
        "kv_b_proj.weight",
        "o_proj.weight",
    }
    kv_rank, rope = DEEPSEEK["kv_lora_rank"], DEEPSEEK["qk_rope_head_dim"]
    assert weights["midlayer.self_attn.kv_a_proj_with_mqa.weight"].shape == (
        kv_rank + rope,
        2 * DEEPSEEK["hidden_size"],
    )


def test_trains_in_a_lightning_trainer(tmp_path):
    checks.check_trains_in_lightning_trainer(MLAEagle3Module, DEEPSEEK, tmp_path)


def test_flex_block_mask_gives_the_dense_mask_logits():
    dense = checks.build(MLAEagle3Module, DEEPSEEK, draft_attn_backend="sdpa")
    flex = checks.build(MLAEagle3Module, DEEPSEEK, draft_attn_backend="flex")
    batch = packed_row(random_docs([5, 9], seed=11), 16)
    with torch.no_grad():
        torch.testing.assert_close(flex.draft_logits(batch), dense.draft_logits(batch), rtol=1e-5, atol=1e-5)


def test_config_is_derived_from_the_target_and_works_without_q_lora():
    module = checks.build(MLAEagle3Module, {**DEEPSEEK, "q_lora_rank": None})
    attention = module.draft.midlayer.self_attn
    assert hasattr(attention, "q_proj") and not hasattr(attention, "q_a_proj")
    config = module.draft.config
    assert (config.hidden_size, config.num_attention_heads, config.intermediate_size) == (32, 4, 64)
    assert attention.scale == pytest.approx((8 + 8) ** -0.5)
    output = module.compute_loss(packed_row(random_docs([7, 6], seed=14), 16))
    assert torch.isfinite(output.loss) and output.correct.shape[1] == 3


def test_rope_frequencies_stay_fp32_after_a_bf16_cast():
    module = checks.build(MLAEagle3Module, DEEPSEEK)
    fresh = module.draft.rope.inv_freq.clone()
    module.to(torch.bfloat16)
    assert module.draft.fc.weight.dtype == torch.bfloat16
    assert module.draft.rope.inv_freq.dtype == torch.float32
    assert torch.equal(module.draft.rope.inv_freq, fresh)
    assert "midlayer.self_attn.rope.inv_freq" not in module.draft.state_dict()
    output = module.compute_loss(packed_row(random_docs([6, 7], seed=15), 16))
    assert output.loss.dtype == torch.float32 and torch.isfinite(output.loss)


def test_rope_theta_prefers_rope_parameters_then_top_level_then_default():
    fields = {k: v for k, v in DEEPSEEK.items() if k != "model_type"}
    config = AutoConfig.for_model(
        "deepseek_v3", **fields, rope_parameters={"rope_type": "default", "rope_theta": 5e5}
    )
    assert resolve_rope_theta(config) == 5e5

    class TopLevel:
        rope_theta = 1234.0

    assert resolve_rope_theta(TopLevel()) == 1234.0
    assert resolve_rope_theta(object()) == 10000.0
    draft = build_mla_draft(config, vocab_size=96, draft_vocab_size=96)
    torch.testing.assert_close(draft.rope.inv_freq, default_inverse_frequencies(config.qk_rope_head_dim, 5e5))


def test_yarn_correction_applies_only_past_the_original_context():
    yarn = {"factor": 40.0, "beta_fast": 32, "beta_slow": 1, "original_max_position_embeddings": 4096}
    plain = default_inverse_frequencies(64, 10000.0)
    short = deepseek_rope_table(64, 10000.0, 4096, yarn).inv_freq
    long = deepseek_rope_table(64, 10000.0, 163840, yarn).inv_freq
    incomplete = deepseek_rope_table(64, 10000.0, 163840, {"factor": 40.0}).inv_freq
    torch.testing.assert_close(short, plain)
    torch.testing.assert_close(incomplete, plain)
    # High frequencies are kept, low ones divided by the factor, with a ramp between.
    assert long[0] == plain[0] and math.isclose(float(long[-1]), float(plain[-1]) / 40.0, rel_tol=1e-5)
    assert ((long <= plain + 1e-12) & (long >= plain / 40.0 - 1e-12)).all()


def test_mla_config_rejects_a_target_without_mla_fields():
    with pytest.raises(ValueError, match="MLA fields"):
        MLADraftConfig.from_target(AutoConfig.for_model("llama"), vocab_size=96, draft_vocab_size=96)


def test_the_served_rope_scaling_is_the_rotation_the_draft_computes():
    """vLLM ramps whenever rope_scaling is set and scales by mscale / mscale_all_dim; the draft ramps only past
    the original context and never scales, so the served field says exactly what the draft does."""
    yarn = {
        "rope_type": "yarn",
        "factor": 40.0,
        "beta_fast": 32,
        "beta_slow": 1,
        "original_max_position_embeddings": 4096,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    }
    served = vllm_deepseek_rope_scaling(yarn, 163840)
    assert served == {**yarn, "mscale": 0.0, "mscale_all_dim": 0.0}
    assert vllm_deepseek_rope_scaling(served, 163840) == served
    assert vllm_deepseek_rope_scaling(yarn, 4096) is None  # the draft uses plain RoPE there
    assert vllm_deepseek_rope_scaling({"rope_type": "linear", "factor": 2.0}, 163840) is None
    assert vllm_deepseek_rope_scaling(None, 163840) is None
    torch.testing.assert_close(
        deepseek_rope_table(64, 10000.0, 163840, served).inv_freq,
        deepseek_rope_table(64, 10000.0, 163840, yarn).inv_freq,
        rtol=0,
        atol=0,
    )


def test_an_mla_draft_without_q_lora_warns_that_vllm_cannot_load_it(tmp_path):
    module = checks.build(MLAEagle3Module, {**DEEPSEEK, "q_lora_rank": None})
    with torch.no_grad():
        module.draft.lm_head.weight.mul_(1.5)
    with pytest.warns(UserWarning, match="vLLM 0.32's Eagle3DeepseekV2ForCausalLM cannot load it"):
        module.export(tmp_path / "draft")
