"""DSpark exports: NeMo's Qwen3DSparkModel layout and the SpecForge / SGLang DSparkDraftModel layout
(keys, shapes, config fields) and their guards (reloading either into DSparkModule, and exporting a
Lightning checkpoint in either: tests/families/test_conformance.py)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from lightning_drafts.dspark import load_exported_draft
from tests.block_draft_cases import BLOCK, MASK_TOKEN, perturb
from tests.families.dspark.test_dspark import LAYERS, make

H, V, R = 32, 96, 8  # tiny qwen3 hidden size and vocabulary, the tests' Markov rank
BACKBONE = {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.1.self_attn.k_norm.weight"}
HEADS = {"markov_head.markov_w1.weight", "markov_head.markov_w2.weight"}
HEADS |= {"confidence_head.proj.weight", "confidence_head.proj.bias"}


@pytest.fixture(scope="module")
def trained():
    module = make()
    perturb(module)
    return module


def test_nemo_layout_has_neMo_keys_and_round_trips(trained, tmp_path):
    module = trained
    path = module.export(tmp_path / "nemo", layout="nemo")
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == ["Qwen3DSparkModel"] and config["model_type"] == "qwen3"
    expected = {
        "block_size": BLOCK,
        "mask_token_id": MASK_TOKEN,
        "target_layer_ids": LAYERS,
        "num_anchors": 3,
        "num_target_layers": 8,
        "num_hidden_layers": 2,
        "markov_rank": R,
        "markov_head_type": "vanilla",
        "enable_confidence_head": True,
        "confidence_head_with_markov": True,
        "tie_word_embeddings": False,
        "layer_types": ["full_attention"] * 2,
    }
    assert {key: config[key] for key in expected} == expected
    weights = load_file(str(path / "model.safetensors"))
    assert set(weights) == set(module.draft.state_dict())
    assert BACKBONE | HEADS | {"embed_tokens.weight", "lm_head.weight"} <= set(weights)
    assert not any(k.startswith(("model.", "target.")) or "rotary" in k for k in weights)

    draft, _ = load_exported_draft(path)
    for name, value in module.draft.state_dict().items():
        assert torch.equal(draft.state_dict()[name], value), name
    # Reloading it into a module with its loss is the conformance suite's (both layouts).


def test_specforge_layout_keys_shapes_config_and_reload(trained, tmp_path):
    module = trained
    path = module.export(tmp_path / "sf")  # the default: the serving layout
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == ["DSparkDraftModel"] and config["model_type"] == "qwen3"
    assert config["auto_map"] == {"AutoModel": "dspark.DSparkDraftModel"} and config["is_causal"] is False
    assert (
        config["block_size"] == BLOCK and config["num_target_layers"] == 8 and config["rope_theta"] == 10000.0
    )
    assert config["dflash_config"] == {
        "attention_mode": "gqa",
        "mask_token_id": MASK_TOKEN,
        "target_layer_ids": LAYERS,
        "projector_type": "dspark",
        "markov_rank": R,
        "markov_head_type": "vanilla",
        "confidence_head_alpha": 1.0,
        "enable_confidence_head": True,
        "confidence_head_with_markov": True,
    }
    assert config["markov_rank"] == R and config["enable_confidence_head"] is True  # DSparkConfig reads these
    weights = load_file(str(path / "model.safetensors"))
    assert BACKBONE | HEADS <= set(weights)
    assert not any(k.startswith(("embed_tokens", "lm_head", "model.", "target.")) for k in weights)
    shapes = {name: tuple(weights[name].shape) for name in ("fc.weight", *sorted(HEADS))}
    assert shapes == {
        "fc.weight": (H, len(LAYERS) * H),
        "markov_head.markov_w1.weight": (V, R),
        "markov_head.markov_w2.weight": (V, R),
        "confidence_head.proj.weight": (1, H + R),
        "confidence_head.proj.bias": (1,),
    }

    # Reloaded into a module (the embedding / LM head: the target's copies) by the conformance suite.
    with pytest.raises(ValueError, match="SpecForge-layout export"):
        load_exported_draft(path)


def test_export_guards_raise_value_error(trained, tmp_path):
    module = trained
    with pytest.raises(ValueError, match="layout 'vllm' is unknown"):
        module.export(tmp_path / "x", layout="vllm")
    with pytest.raises(ValueError, match="only the vanilla Markov head.*--layout nemo"):
        make(markov_head_type="gated").export(tmp_path / "gated", layout="specforge")
    with pytest.raises(ValueError, match="freeze_embeddings=False"):
        make(freeze_embeddings=False).export(tmp_path / "unfrozen", layout="specforge")
    rnn = make(markov_head_type="rnn").export(tmp_path / "rnn", layout="nemo")  # NeMo keeps every head
    assert "markov_head.joint_proj.weight" in load_file(str(rnn / "model.safetensors"))
    # Without a layout, a draft SGLang cannot serve still exports: NeMo's layout, with the reason.
    for options in ({"markov_head_type": "gated"}, {"freeze_embeddings": False}):
        with pytest.warns(UserWarning, match="writing NeMo's Qwen3DSparkModel layout instead"):
            path = make(**options).export(tmp_path / "auto")
        assert json.loads((path / "config.json").read_text())["architectures"] == ["Qwen3DSparkModel"]

    path = module.export(tmp_path / "ok")
    with pytest.raises(ValueError, match="matching block_size"):
        make(block_size=5).load_exported(path)
    with pytest.raises(ValueError, match="config.json is missing"):
        module.load_exported(tmp_path / "nothing")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "config.json").write_text(json.dumps({"architectures": ["DFlashDraftModel"]}))
    with pytest.raises(ValueError, match="DSparkDraftModel"):
        module.load_exported(tmp_path / "other")


def test_bf16_export_reloads_with_fp32_rope(tmp_path):
    module = make()
    module.to(torch.bfloat16)
    draft, config = load_exported_draft(module.export(tmp_path / "bf16", layout="nemo"))
    assert config["torch_dtype"] == "bfloat16" and draft.fc.weight.dtype == torch.bfloat16
    assert draft.rotary_emb.inv_freq.dtype == torch.float32
