"""DSpark exports: NeMo's Qwen3DSparkModel layout and the SpecForge / SGLang DSparkDraftModel layout
(keys, shapes, config fields) and their guards (reloading either into DSparkModule, and exporting a
Lightning checkpoint in either: tests/families/test_conformance.py)."""

from __future__ import annotations

import inspect
import json
import re
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from lightning_drafts import DSparkModule
from lightning_drafts.dspark import load_exported_draft
from lightning_drafts.dspark.speculate import load_served_draft
from lightning_drafts.serving.export_files import missing_remote_code
from tests.families.dspark.test_dspark import LAYERS, fixed_anchors, make
from tests.support.block_draft_cases import BLOCK, MASK_TOKEN, documents, perturb

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
    # No auto_map: the export ships no modelling code for AutoModel's trust_remote_code to import.
    assert "auto_map" not in config and config["is_causal"] is False
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
    with pytest.raises(ValueError, match="freeze_embeddings=False.*--layout nemo"):
        make(freeze_embeddings=False).export(tmp_path / "unfrozen", layout="specforge")
    # Without a layout, a draft SGLang cannot serve still exports: NeMo's layout, with the reason.
    with pytest.warns(UserWarning, match="writing NeMo's Qwen3DSparkModel layout instead"):
        path = make(freeze_embeddings=False).export(tmp_path / "auto")
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


# --- the Markov heads as SpecForge and SGLang read them ------------------------------------------------

# The head tensors SpecForge's and SGLang's DSpark loaders build (V = vocab, H = hidden, r = markov_rank),
# written from their source, not from this project's heads:
# * SGLang python/sglang/srt/models/dspark.py (sgl-project/sglang 01f476234ab4, 37e23874aa15):
#   VanillaMarkov (markov_w1 = Embedding(V, r), markov_w2 = Linear(r, V, bias=False)), GatedMarkovHead
#   (+ gate_proj = Linear(H + r, r)), RNNHead (+ joint_proj = Linear(2 r + H, 3 r)), DSparkConfidenceHead
#   (proj = Linear(H + r, 1)); its load_weights raises on a markov_head.* name the head lacks and skips
#   embed_tokens.* / lm_head.*.
# * SpecForge specforge/modeling/draft/dspark_heads.py (sgl-project/SpecForge 87abca18037e):
#   VanillaMarkovHead, GatedMarkovHead, RNNMarkovHead, AcceptRatePredictor with the same names and shapes.
READER_MARKOV = {"markov_head.markov_w1.weight": (V, R), "markov_head.markov_w2.weight": (V, R)}
READER_HEADS = {
    "vanilla": READER_MARKOV,
    "gated": {
        **READER_MARKOV,
        "markov_head.gate_proj.weight": (R, H + R),
        "markov_head.gate_proj.bias": (R,),
    },
    "rnn": {
        **READER_MARKOV,
        "markov_head.joint_proj.weight": (3 * R, 2 * R + H),
        "markov_head.joint_proj.bias": (3 * R,),
    },
}
READER_CONFIDENCE = {"confidence_head.proj.weight": (1, H + R), "confidence_head.proj.bias": (1,)}
HEAD_TYPES = list(READER_HEADS)


def _reader_bias(weights: dict, head_type: str, hidden: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
    """The Markov logit bias ``[M, K, V]`` as SGLang's heads compute it on a block (``apply_block_logits``):
    gated = ``W2 (sigmoid(gate_proj([h, e])) * e)``; rnn = a zero-started state over the block's slots,
    ``z = [state, e_k, h_k]``, ``joint_proj(z)`` split into (gate, candidate, output), the bias of slot k
    ``W2 tanh(output)`` and the next state ``g * state + (1 - g) * tanh(candidate)``."""
    w2 = weights["markov_head.markov_w2.weight"]
    latent = weights["markov_head.markov_w1.weight"][previous]
    if head_type == "vanilla":
        return latent @ w2.T
    if head_type == "gated":
        gate_in = torch.cat([hidden, latent], dim=-1)
        gate = torch.sigmoid(
            gate_in @ weights["markov_head.gate_proj.weight"].T + weights["markov_head.gate_proj.bias"]
        )
        return (gate * latent) @ w2.T
    state, biases = torch.zeros_like(latent[:, 0]), []
    for k in range(latent.shape[1]):
        z = torch.cat([state, latent[:, k], hidden[:, k]], dim=-1)
        joint = z @ weights["markov_head.joint_proj.weight"].T + weights["markov_head.joint_proj.bias"]
        gate, candidate, output = joint.chunk(3, dim=-1)
        gate = torch.sigmoid(gate)
        state = gate * state + (1 - gate) * torch.tanh(candidate)
        biases.append(torch.tanh(output) @ w2.T)
    return torch.stack(biases, dim=1)


@pytest.fixture(scope="module")
def head_exports(tmp_path_factory):
    """``head_exports(head_type)``: a perturbed draft with that Markov head and its SpecForge-layout
    export, built once per module."""
    root, built = tmp_path_factory.mktemp("heads"), {}

    def export(head_type: str):
        if head_type not in built:
            module = make(markov_head_type=head_type)
            perturb(module)
            built[head_type] = (module, module.export(root / head_type, layout="specforge"))
        return built[head_type]

    return export


@pytest.mark.parametrize("head_type", HEAD_TYPES)
def test_specforge_layout_heads_are_exactly_what_the_readers_build(head_type, head_exports, tmp_path):
    module, path = head_exports(head_type)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback to NeMo's layout: every head type is served
        default = module.export(tmp_path / "default")
    assert json.loads((default / "config.json").read_text())["architectures"] == ["DSparkDraftModel"]
    config = json.loads((path / "config.json").read_text())
    # SGLang reads markov_head_type from dspark_config, else the top level; SpecForge's DSparkConfig the top level.
    assert "dspark_config" not in config
    assert config["markov_head_type"] == config["dflash_config"]["markov_head_type"] == head_type
    assert config["markov_rank"] == config["dflash_config"]["markov_rank"] == R
    weights = load_file(str(path / "model.safetensors"))
    heads = {
        name: tuple(value.shape)
        for name, value in weights.items()
        if name.startswith(("markov_head.", "confidence_head."))
    }
    assert heads == {**READER_HEADS[head_type], **READER_CONFIDENCE}


@pytest.mark.parametrize("head_type", HEAD_TYPES)
def test_exported_heads_compute_the_readers_bias(head_type, head_exports):
    """The exported weights, run through SGLang's head math (written out above), give the trained bias."""
    module, path = head_exports(head_type)
    weights = load_file(str(path / "model.safetensors"))
    generator = torch.Generator().manual_seed(5)
    hidden = torch.randn(3, BLOCK, H, generator=generator)
    previous = torch.randint(0, V, (3, BLOCK), generator=generator)
    with torch.no_grad():
        logits, _ = module.draft.heads(hidden, previous)
        base = module.draft.lm_head(hidden)
    torch.testing.assert_close(
        logits - base, _reader_bias(weights, head_type, hidden, previous), rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize("head_type", HEAD_TYPES)
def test_specforge_layout_round_trips_every_head(head_type, head_exports, tmp_path):
    """Export, reload into a differently initialised module and through the served reader: the same
    weights and identical logits."""
    module, path = head_exports(head_type)
    reloaded = make(markov_head_type=head_type)
    perturb(reloaded, seed=7)
    reloaded.load_exported(path)
    for name, value in module.draft.state_dict().items():
        assert torch.equal(reloaded.draft.state_dict()[name], value), name
    served, fields = load_served_draft(path, module.target)
    assert fields == module.dspark_config()
    batch = {
        "input_ids": torch.stack(documents([12, 12], seed=3)),
        "loss_mask": torch.ones(2, 12, dtype=torch.long),
    }
    anchors = fixed_anchors(module, batch)
    with torch.no_grad():
        expected = module.compute_loss(batch, anchors=anchors)
        again = reloaded.compute_loss(batch, anchors=anchors)
    assert torch.equal(again.loss, expected.loss)
    generator = torch.Generator().manual_seed(9)
    hidden = torch.randn(2, BLOCK, H, generator=generator)
    previous = torch.randint(0, V, (2, BLOCK), generator=generator)
    with torch.no_grad():
        trained = module.draft.heads(hidden, previous)
        for draft in (reloaded.draft, served):
            logits, confidence = draft.heads(hidden, previous)
            assert torch.equal(logits, trained[0]) and torch.equal(confidence, trained[1])


@pytest.mark.parametrize("layout", ["specforge", "nemo"])
def test_every_file_auto_map_names_is_in_the_export(layout, trained, tmp_path):
    path = trained.export(tmp_path / layout, layout=layout)
    config = json.loads((path / "config.json").read_text())
    assert missing_remote_code(config, path) == []
    # The check itself: a reference to a module file the directory lacks is named, one it has is not.
    assert missing_remote_code({"auto_map": {"AutoModel": "dspark.DSparkDraftModel"}}, path) == ["dspark.py"]
    (tmp_path / "code").mkdir()
    (tmp_path / "code" / "dspark.py").write_text("")
    assert (
        missing_remote_code({"auto_map": {"AutoModel": "dspark.DSparkDraftModel"}}, tmp_path / "code") == []
    )


def test_the_docs_sglang_command_drafts_one_block():
    """SGLang drafts --speculative-num-draft-tokens - 1 tokens a round and refuses any value but
    block_size + 1 (python/sglang/srt/speculative/dspark_components/dspark_config.py,
    dspark_gamma_from_num_draft_tokens; the server-argument hook's _handle_dspark), so the DSpark guide's
    command passes the default block_size + 1."""
    guide = (Path(__file__).resolve().parents[3] / "docs" / "guides" / "dspark.md").read_text()
    commands = re.findall(
        r"--speculative-algorithm DSPARK.*?--speculative-num-draft-tokens (\d+)", guide, re.S
    )
    block_size = inspect.signature(DSparkModule).parameters["block_size"].default
    assert commands and all(int(tokens) == block_size + 1 for tokens in commands), commands
