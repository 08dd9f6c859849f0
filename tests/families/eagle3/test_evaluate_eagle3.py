"""Serving-faithful evaluation of EAGLE-3 and MLA-EAGLE-3 exports: what is EAGLE-3's own. The export
validator names each defect, the LM head must have left its initialisation, the MLA layout needs its RoPE
and latent ranks, and the served draft (from config.json) and chain equal the trained ones.

(Lossless served decoding and the reload of every family: tests/families/test_conformance.py; a perfect
draft and a d2t the validator cannot see: tests/serving/test_served_evaluate.py; the CLI and the
callback: tests/cli/test_evaluate_cli.py, tests/serving/test_served_acceptance_callback.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lightning_drafts import Eagle3Module, MLAEagle3Module
from lightning_drafts.core.batch import validate_batch
from lightning_drafts.eagle3 import Eagle3Base
from lightning_drafts.eagle3.reload import load_exported_draft
from lightning_drafts.eagle3.rope import default_inverse_frequencies
from lightning_drafts.eagle3.speculate import load_speculator
from lightning_drafts.eagle3.ttt import TTTCache
from lightning_drafts.serving.family import VerifiedPrefix
from lightning_drafts.workflows.export import validate_export
from tests.families.eagle3.cases import STEPS, perfect_module
from tests.support.builders import TINY_TARGETS, VOCAB, random_docs, rewrite_export
from tests.support.eagle3_checks import frequencies

FAMILIES = [(Eagle3Module, "llama"), (MLAEagle3Module, "deepseek_v3")]
FAMILY_IDS = ["eagle3", "mla_eagle3"]

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def perfect_export(tmp_path_factory) -> tuple[Eagle3Base, Path]:
    module = perfect_module(Eagle3Module, "llama")
    return module, module.export(tmp_path_factory.mktemp("perfect") / "draft")


def _shift_vllm_ids_to_output_convention(config: dict) -> None:
    config["eagle_aux_hidden_state_layer_ids"] = list(
        config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    )


def _shift_engine_ids(config: dict) -> None:
    config["eagle_aux_hidden_state_layer_ids"] = [i + 1 for i in config["eagle_aux_hidden_state_layer_ids"]]
    config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [
        i + 1 for i in config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    ]


def _shift_every_id(config: dict) -> None:
    _shift_engine_ids(config)
    config["lightning_drafts"]["target_layer_ids"] = [
        i + 1 for i in config["lightning_drafts"]["target_layer_ids"]
    ]


def _absolute_d2t(tensors: dict) -> None:
    tensors["d2t"] = tensors["d2t"] + torch.arange(tensors["d2t"].numel())


def _duplicate_d2t(tensors: dict) -> None:
    tensors["d2t"][1] = tensors["d2t"][0] - 1  # draft ids 0 and 1 now name the same target id


def _random_embedding(tensors: dict) -> None:
    tensors["embed_tokens.weight"] = torch.randn_like(tensors["embed_tokens.weight"])


BROKEN_EXPORTS = {
    "vllm ids in the output convention": (
        _shift_vllm_ids_to_output_convention,
        None,
        r"eagle_aux_hidden_state_layer_ids: is \[1, 3, 7\]",
    ),
    "engine ids shifted from training": (
        _shift_engine_ids,
        None,
        r"eagle_config\.eagle_aux_hidden_state_layer_ids: is \[2, 4, 8\]",
    ),
    "every id shifted past the target": (_shift_every_id, None, "outside the target's 8 decoder layers"),
    "convention not recorded": (
        lambda c: c["lightning_drafts"].pop("layer_id_convention"),
        None,
        "layer_id_convention",
    ),
    "dropped lm_head": (None, lambda t: t.pop("lm_head.weight"), "lm_head.weight: missing"),
    "zeroed lm_head": (None, lambda t: t["lm_head.weight"].zero_(), "lm_head.weight: is constant"),
    "d2t as absolute ids": (None, _absolute_d2t, "d2t: .*absolute target ids"),
    "d2t not one to one": (None, _duplicate_d2t, "d2t: maps two draft ids"),
    "t2d out of step": (None, lambda t: t["t2d"].logical_not_(), "t2d: marks"),
    "random embedding": (None, _random_embedding, "embed_tokens.weight: differs from the target"),
    "NaN weight": (None, lambda t: t["fc.weight"].fill_(float("nan")), "fc.weight: holds NaN"),
    "rope_theta dropped": (lambda c: c.pop("rope_theta"), None, "rope_theta"),
    "rope_scaling dropped": (lambda c: c.pop("rope_scaling"), None, "rope_scaling: missing"),
    "head_dim dropped": (lambda c: c.pop("head_dim"), None, "head_dim: missing"),
    "two layers": (lambda c: c.update(num_hidden_layers=2), None, "num_hidden_layers"),
}


@pytest.mark.parametrize("case", list(BROKEN_EXPORTS))
def test_the_validator_names_each_defect(case, perfect_export, tmp_path):
    module, export = perfect_export
    config_edit, tensor_edit, message = BROKEN_EXPORTS[case]
    broken = rewrite_export(export, tmp_path / "broken", config_edit, tensor_edit)
    with pytest.raises(ValueError, match=message):
        validate_export(broken, module.target)


def test_an_lm_head_still_at_its_initialisation_is_refused(tmp_path):
    torch.manual_seed(0)
    module = Eagle3Module(
        TINY_TARGETS["llama"], ttt_length=STEPS, draft_vocab_size=48, token_frequencies=frequencies()
    )
    export = module.export(tmp_path / "untrained")
    with pytest.raises(ValueError, match="lm_head.weight: is bit-identical to its random initialisation"):
        validate_export(export, module.target)


def mla_export(directory: Path, target: dict = TINY_TARGETS["deepseek_v3"]) -> tuple[MLAEagle3Module, Path]:
    """An MLA draft whose LM head has left its initialisation, and its export."""
    torch.manual_seed(0)
    module = MLAEagle3Module(target, ttt_length=STEPS, draft_vocab_size=48, token_frequencies=frequencies())
    with torch.no_grad():
        module.draft.lm_head.weight.mul_(1.5)
    return module, module.export(directory)


def test_the_mla_layout_needs_interleaved_rope_and_its_latent_ranks(tmp_path):
    module, export = mla_export(tmp_path / "draft")

    def break_config(config: dict) -> None:
        config["rope_interleave"] = False
        config.pop("kv_lora_rank")

    broken = rewrite_export(export, tmp_path / "broken", config_edit=break_config)
    with pytest.raises(ValueError, match="(?s)kv_lora_rank: missing.*rope_interleave"):
        validate_export(broken, module.target)


# A YaRN scaling past the tiny target's short original context, with DeepSeek-V3's magnitudes.
TINY_YARN = {
    "rope_type": "yarn",
    "factor": 4.0,
    "beta_fast": 32,
    "beta_slow": 1,
    "original_max_position_embeddings": 64,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}
VLLM_BREAKING_MLA_CONFIGS = {
    "deepseek_v3 model_type (vLLM builds its MTP model)": (
        {"model_type": "deepseek_v3"},
        "model_type: is 'deepseek_v3'; write 'deepseek_v2'",
    ),
    "the target's YaRN magnitudes copied": (
        {"rope_scaling": TINY_YARN},
        r"rope_scaling: is .*'mscale': 1.0.*write .*\"mscale\": 0.0, \"mscale_all_dim\": 0.0",
    ),
    "a YaRN ramp the draft does not apply": (
        {
            "rope_scaling": {
                **TINY_YARN,
                "original_max_position_embeddings": 4096,
                "mscale": 0.0,
                "mscale_all_dim": 0.0,
            }
        },
        "rope_scaling: is .*; write null",
    ),
}


@pytest.mark.parametrize("case", list(VLLM_BREAKING_MLA_CONFIGS))
def test_the_mla_layout_refuses_what_vllm_would_serve_differently(case, tmp_path):
    module, export = mla_export(tmp_path / "draft")
    fields, message = VLLM_BREAKING_MLA_CONFIGS[case]
    broken = rewrite_export(export, tmp_path / "broken", config_edit=lambda config: config.update(fields))
    with pytest.raises(ValueError, match=message):
        validate_export(broken, module.target)


def test_the_served_mla_draft_under_yarn_is_the_trained_one(tmp_path):
    """A YaRN target's MLA draft exports the ramp without vLLM's magnitudes, and the draft built from that
    config computes bit for bit what the trained draft computes, past the original context too."""
    yarn = {**TINY_YARN, "rope_theta": 10000.0}
    module, export = mla_export(tmp_path / "draft", {**TINY_TARGETS["deepseek_v3"], "rope_parameters": yarn})
    draft, config = load_exported_draft(export)
    ramp = {k: yarn[k] for k in ("factor", "beta_fast", "beta_slow", "original_max_position_embeddings")}
    assert config["rope_scaling"] == {"rope_type": "yarn", **ramp, "mscale": 0.0, "mscale_all_dim": 0.0}
    assert torch.equal(draft.rope.inv_freq, module.draft.rope.inv_freq)
    assert not torch.equal(draft.rope.inv_freq, default_inverse_frequencies(8, 10000.0))
    ids = torch.randint(1, VOCAB, (1, 9), generator=torch.Generator().manual_seed(4))
    hidden = torch.randn(1, 9, 32, generator=torch.Generator().manual_seed(5))
    positions = torch.arange(9)[None] + 100
    mask = torch.ones(9, 9, dtype=torch.bool).tril()[None, None]
    with torch.no_grad():
        served = draft.step(ids, hidden, positions, TTTCache(), mask)
        trained = module.draft.step(ids, hidden, positions, TTTCache(), mask)
    torch.testing.assert_close(served, trained, rtol=0, atol=0)


def test_the_served_draft_is_built_from_the_config_and_matches_the_trained_one(tmp_path):
    """Shapes and RoPE (here llama3-scaled) come from config.json, not the target, and agree with training."""
    scaled = {
        **TINY_TARGETS["llama"],
        "rope_parameters": {
            "rope_type": "llama3",
            "rope_theta": 50000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    }
    torch.manual_seed(0)
    module = Eagle3Module(scaled, ttt_length=STEPS, draft_vocab_size=48, token_frequencies=frequencies())
    with torch.no_grad():
        module.draft.lm_head.weight.mul_(1.5)
    draft, config = load_exported_draft(module.export(tmp_path / "draft"))
    assert config["rope_scaling"]["rope_type"] == "llama3" and config["rope_theta"] == 50000.0
    trained_rope = module.draft.midlayer.self_attn.rope
    assert torch.equal(draft.midlayer.self_attn.rope.inv_freq, trained_rope.inv_freq)
    ids = torch.randint(1, VOCAB, (1, 9), generator=torch.Generator().manual_seed(4))
    hidden = torch.randn(1, 9, 32, generator=torch.Generator().manual_seed(5))
    positions = torch.arange(9)[None] + 40  # past original_max_position_embeddings, where scaling matters
    mask = torch.ones(9, 9, dtype=torch.bool).tril()[None, None]
    with torch.no_grad():
        served = draft.step(ids, hidden, positions, TTTCache(), mask)
        trained = module.draft.step(ids, hidden, positions, TTTCache(), mask)
    torch.testing.assert_close(served, trained, rtol=0, atol=0)


@pytest.mark.parametrize(("module_class", "name"), FAMILIES, ids=FAMILY_IDS)
def test_the_served_chain_equals_the_training_unroll(module_class, name, tmp_path):
    """Drafting from the exported files, fed the true tokens, gives training's TTT logits at every depth:
    same captured layers, RoPE positions, context keys (Block 1) and per-chain diagonal keys."""
    torch.manual_seed(0)
    module = module_class(
        TINY_TARGETS[name], ttt_length=STEPS, draft_vocab_size=48, token_frequencies=frequencies()
    )
    with torch.no_grad():
        for parameter in module.draft.parameters():
            if parameter.requires_grad:  # away from the init everywhere, norms included
                parameter.add_(0.05 * torch.randn_like(parameter))
    speculator = load_speculator(module.export(tmp_path / "draft"), module.target, STEPS)
    document = random_docs([14], seed=60)[0]
    with torch.no_grad():
        trained = module.draft_logits({"input_ids": document[None]})  # [K, 1, T, V_d]
    for slot in (0, 5, 10):
        context = validate_batch({"input_ids": document[None, : slot + 1]})
        features = module.target(context, speculator.target_layer_ids)
        prefix = VerifiedPrefix(
            document[: slot + 2],
            tuple(h[0] for h in features.hidden_states),
            features.last_hidden_state[0],
            module.target,
        )
        tokens, served = speculator.chain(prefix, forced=document[slot + 2 : slot + 1 + STEPS])
        torch.testing.assert_close(served, trained[:, 0, slot], rtol=1e-5, atol=1e-5)
        first = trained[0, 0, slot].argmax()
        assert int(tokens[0]) == int(module.draft.selected_token_ids[first])
