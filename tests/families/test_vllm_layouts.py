"""Exports read by vLLM's own model code, without serving: DSpark (both layouts), which vLLM's CPU build refuses
to run ("Model Runner V1 does not support: dspark speculative decoding"), and MLA-EAGLE-3 (served for real in
``tests/families/eagle3/test_mla_vllm.py``; this is the cheap second look).

``tests/scripts/vllm_static_layout.py`` resolves each export through vLLM's config pipeline, builds the draft
class on the CPU with every parameter at a sentinel and loads the export through the class's
``load_weights``. So: every weight vLLM expects comes from the export (names after vLLM's renames and
stacking, shapes as its loaders assert), nothing the export holds is dropped, and every config field the
class reads is one the export writes, with the value written, or one of the defaults pinned below.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.families.dspark.cases import MASK, make, trained_module
from tests.families.eagle3 import vllm_cases
from tests.support.block_draft_cases import perturb
from tests.support.vllm_subprocess import run_vllm_script

GATED = "dspark-specforge-gated"  # loaded, not compared with CASES: vLLM refuses it
# Training-only tensors vLLM's loaders skip by name.
SKIPPED_BY_VLLM = {"t2d"}

DSPARK_DEFAULTS = {
    "add_swa_attention_sink_bias": "no sliding-window attention sink",
    "dspark_draft_topk": "no top-k truncation of the draft distribution (a serving option)",
    "eagle_aux_hidden_state_layer_ids": "a DSpark draft's captured layers are its target_layer_ids",
    "eagle_config": "a DSpark draft has no EAGLE section",
    "is_neox_style": "Qwen3's rotate-half RoPE, vLLM's default",
    "logit_scale": "no logit scaling (1.0)",
    "target_hidden_size": "the draft is as wide as the target (hidden_size)",
    "use_aux_hidden_state": "captured target features are used (True)",
}
MLA_DEFAULTS = {
    "fc_norm": "no EAGLE-3.1 per-chunk norms before fc",
    "index_topk": "no DeepSeek-V3.2 sparse indexer",
    "logit_scale": "no logit scaling (1.0)",
    "norm_before_residual": "the residual is the raw carried state",
    "norm_output": "the pre-norm state is carried to the next depth",
    "num_aux_hidden_states": "three, from eagle_config's layer ids",
}
CASES = {
    "dspark-specforge": {
        "model_class": "Qwen3DSparkForCausalLM",
        # vLLM shares these from the target when a draft omits them, as the SpecForge layout does;
        # mask_embedding is an unused placeholder its loader drops.
        "unloaded": ["lm_head.weight", "model.embed_tokens.weight", "model.mask_embedding"],
        "defaults": {**DSPARK_DEFAULTS, "mask_token_id": "read from dflash_config.mask_token_id first"},
        "set_by_vllm": {"draft_vocab_size"},  # = vocab_size: DSpark drafts the whole vocabulary
        # vLLM's name for a Qwen3 DSparkDraftModel (the bare name is its DeepSeek-V4 DSpark).
        "rewritten": {"architectures": ["Qwen3DSparkModel"]},
    },
    "dspark-nemo": {
        "model_class": "Qwen3DSparkForCausalLM",
        "unloaded": ["model.mask_embedding"],
        "defaults": {
            **DSPARK_DEFAULTS,
            "dflash_config": "NeMo's layout keeps mask_token_id and target_layer_ids at the top level",
            "dspark_target_layer_ids": "read from the top-level target_layer_ids next",
            "is_causal": "absent, full-attention layer_types make every draft layer non-causal",
        },
        "set_by_vllm": {"draft_vocab_size"},
        "rewritten": {},
    },
    "mla_eagle3": {
        "model_class": "Eagle3DeepseekV2ForCausalLM",
        "unloaded": [],
        "defaults": MLA_DEFAULTS,
        # transformers builds rope_parameters from rope_theta / rope_scaling (checked below).
        "set_by_vllm": {"rope_parameters"},
        "rewritten": {},
    },
}


@pytest.fixture(scope="module")
def checked(tmp_path_factory) -> dict[str, tuple[dict, dict]]:
    """Per case: ``(the export's config.json, what vLLM made of the export)``, all in one vLLM process."""
    root = tmp_path_factory.mktemp("vllm_layouts")
    dspark = trained_module()
    dspark.target.model.save_pretrained(root / "qwen3")
    mla_target = vllm_cases.save_target(root / "deepseek_v3")
    gated = make(dspark.target.model, markov_head_type="gated")
    perturb(gated)
    exports = {
        "dspark-specforge": dspark.export(root / "dspark-specforge", layout="specforge"),
        "dspark-nemo": dspark.export(root / "dspark-nemo", layout="nemo"),
        "mla_eagle3": vllm_cases.mla_module(mla_target).export(root / "mla_eagle3"),
        GATED: gated.export(root / GATED, layout="specforge"),
    }
    targets = {case: root / "qwen3" for case in exports} | {"mla_eagle3": mla_target}
    requests = [
        {
            "target": str(targets[case]),
            "draft": str(exports[case]),
            "method": "eagle3" if case == "mla_eagle3" else "dspark",
            # DSpark: vLLM derives the tokens per round from the export's block_size.
            "num_speculative_tokens": vllm_cases.STEPS if case == "mla_eagle3" else None,
            "max_model_len": 256,
        }
        for case in exports
    ]
    results = run_vllm_script("vllm_static_layout.py", requests, root)
    configs = [json.loads((Path(exports[case]) / "config.json").read_text()) for case in exports]
    return {case: (config, result) for case, config, result in zip(exports, configs, results, strict=True)}


def test_vllm_refuses_a_gated_markov_head_at_load(checked):
    """vLLM 0.32's Qwen3DSparkForCausalLM builds only the vanilla Markov head (SpecForge and SGLang build
    gated / rnn ones too): it refuses the gated head's weights loudly rather than serving without them."""
    _, result = checked[GATED]
    assert "no module or parameter named 'markov_head.gate_up_proj'" in result["load_error"]


@pytest.mark.parametrize("case", list(CASES))
def test_vllm_loads_every_weight_it_expects_from_the_export_and_drops_none(case, checked):
    _, result = checked[case]
    expected = CASES[case]
    assert "load_error" not in result, result["load_error"]
    assert result["model_class"] == expected["model_class"]
    assert result["unloaded"] == expected["unloaded"]
    assert result["partially_loaded"] == []
    exported = result["exported_elements"]
    assert result["filled_elements"] == sum(n for name, n in exported.items() if name not in SKIPPED_BY_VLLM)
    if "d2t" in exported:
        assert result["d2t_equal"] is True


@pytest.mark.parametrize("case", list(CASES))
def test_every_config_field_vllm_reads_is_written_or_a_pinned_default(case, checked):
    _, result = checked[case]
    expected = CASES[case]
    fields = result["fields_read"]
    defaults = {name for name, field in fields.items() if field["source"] == "default"}
    assert defaults == set(expected["defaults"]), "vLLM reads fields the export does not write"
    assert {name for name, field in fields.items() if field["source"] == "config"} == expected["set_by_vllm"]
    rewritten = {name: field["value"] for name, field in fields.items() if "written" in field}
    assert rewritten == expected["rewritten"], "vLLM read other values than the export wrote"


@pytest.mark.parametrize("case", ["dspark-specforge", "dspark-nemo"])
def test_vllm_derives_dspark_s_serving_settings_from_the_export(case, checked):
    config, result = checked[case]
    ids = (
        config["dflash_config"]["target_layer_ids"]
        if "dflash_config" in config
        else config["target_layer_ids"]
    )
    # vLLM names the layer whose input it captures: each training id (a layer output) + 1.
    assert result["aux_layer_ids"] == [i + 1 for i in ids]
    assert result["num_speculative_tokens"] == config["block_size"]
    assert result["mask_token_id"] == MASK


def test_vllm_reads_the_mla_export_s_layers_and_rotation(checked):
    config, result = checked["mla_eagle3"]
    assert result["aux_layer_ids"] == config["eagle_aux_hidden_state_layer_ids"]
    assert result["num_speculative_tokens"] == vllm_cases.STEPS
    # vLLM's DeepSeek attention renames a YaRN rope_type in place; the ramp and the zero magnitudes are ours.
    rope = result["fields_read"]["rope_parameters"]["value"]
    assert rope == {
        **config["rope_scaling"],
        "rope_type": "deepseek_yarn",
        "rope_theta": config["rope_theta"],
    }
