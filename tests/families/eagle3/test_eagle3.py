"""Eagle3Module (dense Llama-style draft) on a tiny random Llama target: the TTT unroll, its gate, the
vocabulary mapping, guards, the serving layout (packed == padded, isolation, bad batches and the export
round trip: tests/families/test_conformance.py)."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from safetensors.torch import load_file

from lightning_drafts import Eagle3Module, MLAEagle3Module
from lightning_drafts.attention.backends import block_causal_mask
from lightning_drafts.eagle3 import build_vocab_mapping, count_supervised_tokens
from lightning_drafts.eagle3.reload import load_eagle3
from lightning_drafts.eagle3.ttt import TTTCache, step_weights, ttt_attention
from lightning_drafts.workflows.export import validate_export
from tests.support import eagle3_checks as checks
from tests.support.builders import TINY_TARGETS, VOCAB, packed_row, random_docs

LLAMA = TINY_TARGETS["llama"]


def test_doc_remaining_gate_worked_example():
    checks.check_gate_worked_example(Eagle3Module, LLAMA)


def test_every_guard_raises_value_error():
    checks.check_guards(Eagle3Module, LLAMA)


def test_loss_decreases_on_a_fixed_batch():
    checks.check_loss_decreases(Eagle3Module, LLAMA)


def test_export_round_trips_in_the_llama_eagle3_serving_layout(tmp_path):
    exported = checks.check_export_round_trip(Eagle3Module, LLAMA, tmp_path)
    config, weights = exported["config"], exported["weights"]
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["model_type"] == "llama"
    assert config["target_hidden_size"] == LLAMA["hidden_size"]
    expected = {
        "embed_tokens.weight",
        "fc.weight",
        "midlayer.input_layernorm.weight",
        "midlayer.hidden_norm.weight",
        "midlayer.post_attention_layernorm.weight",
        *(f"midlayer.self_attn.{p}_proj.weight" for p in "qkvo"),
        *(f"midlayer.mlp.{p}_proj.weight" for p in ("gate", "up", "down")),
        "norm.weight",
        "lm_head.weight",
        "d2t",
        "t2d",
    }
    assert set(weights) == expected
    hidden = LLAMA["hidden_size"]
    assert weights["fc.weight"].shape == (hidden, 3 * hidden)
    assert weights["midlayer.self_attn.q_proj.weight"].shape[1] == 2 * hidden
    assert weights["lm_head.weight"].shape == (48, hidden)


# A Llama target with attention and MLP biases (as Qwen2-style checkpoints converted to Llama have).
BIASED_LLAMA = {**LLAMA, "attention_bias": True, "mlp_bias": True}
BIASES = sorted(
    [f"midlayer.self_attn.{p}_proj.bias" for p in "qkvo"]
    + [f"midlayer.mlp.{p}_proj.bias" for p in ("gate", "up", "down")]
)


def _exported(module: Eagle3Module, directory) -> tuple[dict, dict]:
    with torch.no_grad():
        module.draft.lm_head.weight.mul_(1.5)  # off its init, which the validator refuses
    path = module.export(directory)
    return json.loads((path / "config.json").read_text()), load_file(str(path / "model.safetensors"))


def test_a_target_with_biases_gets_a_draft_every_engine_serves(tmp_path):
    """SGLang's and SpecForge's LlamaForCausalLMEagle3 build no q/k/v or MLP biases (SGLang drops such
    weights silently). By default the draft follows the target as the reference trainers do, and the
    export says who cannot serve it; draft_biases=False gives a bias-free draft every engine serves."""
    module = checks.build(Eagle3Module, BIASED_LLAMA, draft_biases=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        config, weights = _exported(module, tmp_path / "plain")
    assert config["attention_bias"] is False and config["mlp_bias"] is False
    assert not [name for name in weights if name.endswith(".bias")]
    assert validate_export(tmp_path / "plain", module.target).details["sglang_specforge_servable"] is True
    reloaded = load_eagle3(tmp_path / "plain")
    assert reloaded.draft.state_dict().keys() == module.draft.state_dict().keys()

    for biases in (None, True):
        biased = checks.build(Eagle3Module, BIASED_LLAMA, draft_biases=biases)
        with pytest.warns(
            UserWarning, match=r"midlayer\.mlp\.down_proj\.bias.*SGLang.*train with draft_biases=False"
        ):
            config, weights = _exported(biased, tmp_path / f"biased-{biases}")
        assert config["attention_bias"] is True and config["mlp_bias"] is True
        assert sorted(name for name in weights if name.endswith(".bias")) == BIASES
        details = validate_export(tmp_path / f"biased-{biases}", biased.target).details
        assert details["sglang_specforge_servable"] is False
    again = load_eagle3(tmp_path / "biased-True")  # strict: every bias back in place
    for name, value in biased.draft.state_dict().items():
        assert torch.equal(again.draft.state_dict()[name], value), name
    # A target without biases gives none either way.
    assert not [
        n
        for n in checks.build(Eagle3Module, LLAMA, draft_biases=True).draft.state_dict()
        if n.endswith(".bias")
    ]

    with pytest.raises(ValueError, match="draft_biases = 'yes'; write true, false or null"):
        Eagle3Module(LLAMA, draft_biases="yes")
    with pytest.raises(ValueError, match="draft_biases = True, but the MLA draft has no biases"):
        MLAEagle3Module(TINY_TARGETS["deepseek_v3"], draft_biases=True)


def test_trains_in_a_lightning_trainer(tmp_path):
    checks.check_trains_in_lightning_trainer(Eagle3Module, LLAMA, tmp_path)


@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_ttt_attention_equals_explicit_concatenated_keys(kv_heads):
    """Block 1 + diagonals merged through the log-sum-exp == one softmax over explicitly laid-out keys;
    with grouped key/value heads, query head h reads key/value head h // groups."""
    gen = torch.Generator().manual_seed(0)
    doc_ids = torch.tensor([[0, 0, 0, 1, 1, 1, 1]])
    mask = block_causal_mask(doc_ids)
    batch, heads, width, dim, steps = 1, 4, 7, 8, 4
    cache = TTTCache()
    keys, values = [], []
    for step in range(steps):
        q = torch.randn(batch, heads, width, dim, generator=gen)
        k, v = (torch.randn(batch, kv_heads, width, dim, generator=gen) for _ in range(2))
        out = ttt_attention(q, k, v, cache, mask, scale=dim**-0.5)
        keys.append(k.repeat_interleave(heads // kv_heads, dim=1))
        values.append(v.repeat_interleave(heads // kv_heads, dim=1))
        # Reference: row t attends to K_0[j] (block-causal) and to K_i[t] for 1 <= i <= step.
        all_keys = torch.cat(keys, dim=2)
        all_values = torch.cat(values, dim=2)
        allowed = torch.zeros(width, width * (step + 1), dtype=torch.bool)
        allowed[:, :width] = mask[0, 0]
        for i in range(1, step + 1):
            allowed[torch.arange(width), i * width + torch.arange(width)] = True
        scores = (q @ all_keys.transpose(-1, -2)) * dim**-0.5
        reference = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1) @ all_values
        # attention_with_lse computes in fp32, whatever the input dtype.
        torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-6)


def test_step_weights_decay_and_normalise():
    weights = step_weights(4, 0.8)
    assert sum(weights) == pytest.approx(1.0)
    assert weights[1] / weights[0] == pytest.approx(0.8) and weights[3] / weights[2] == pytest.approx(0.8)
    assert 1 / weights[0] == pytest.approx(2.952)


def test_flex_block_mask_gives_the_dense_mask_logits():
    dense = checks.build(Eagle3Module, LLAMA, draft_attn_backend="sdpa")
    flex = checks.build(Eagle3Module, LLAMA, draft_attn_backend="flex")
    batch = packed_row(random_docs([5, 9], seed=11), 16)
    with torch.no_grad():
        torch.testing.assert_close(flex.draft_logits(batch), dense.draft_logits(batch), rtol=1e-5, atol=1e-5)


def test_vocab_mapping_order_coverage_and_offsets():
    counts = torch.zeros(12, dtype=torch.long)
    counts[[7, 3, 9, 4]] = torch.tensor([50, 30, 30, 10])
    counts[1] = 5
    mapping = build_vocab_mapping(counts, draft_vocab_size=4, special_token_ids=[2, None, 2, 99])
    # Specials first (deduplicated, out-of-range dropped), then by count with ties to the lower id.
    assert mapping.selected_token_ids.tolist() == [2, 7, 3, 9]
    assert mapping.coverage == pytest.approx(110 / 125)
    assert mapping.distinct_tokens == 5 and mapping.filled == 0
    assert (mapping.d2t + torch.arange(4)).tolist() == [2, 7, 3, 9]
    assert mapping.t2d.nonzero().flatten().tolist() == [2, 3, 7, 9]
    identity = build_vocab_mapping(counts, draft_vocab_size=None)
    assert identity.selected_token_ids.tolist() == list(range(12)) and identity.coverage == 1.0
    assert build_vocab_mapping(counts, draft_vocab_size=12).draft_vocab_size == 12
    with pytest.raises(
        ValueError, match="draft_vocab_size = 13 is larger than the target's vocabulary of 12"
    ):
        build_vocab_mapping(counts, draft_vocab_size=13)
    with pytest.raises(ValueError, match="all zero"):
        build_vocab_mapping(torch.zeros(12, dtype=torch.long), draft_vocab_size=4)


def test_vocab_mapping_with_fewer_distinct_tokens_than_the_draft_vocabulary():
    counts = torch.zeros(20, dtype=torch.long)
    counts[[11, 5, 17]] = torch.tensor([3, 9, 1])
    mapping = build_vocab_mapping(counts, draft_vocab_size=8)
    assert mapping.selected_token_ids.tolist() == [5, 11, 17, 0, 1, 2, 3, 4]
    assert mapping.coverage == 1.0 and mapping.distinct_tokens == 3 and mapping.filled == 5
    assert "fewer distinct tokens" in mapping.summary()
    assert mapping.selected_token_ids.unique().numel() == 8


def test_count_supervised_tokens_reads_only_the_loss_mask():
    batch = packed_row(random_docs([4, 3], seed=12), 10)
    batch["loss_mask"][0, :2] = 0
    counts = count_supervised_tokens([batch], VOCAB)
    expected = torch.bincount(batch["input_ids"][0, 2:7], minlength=VOCAB)
    assert torch.equal(counts, expected)


def test_teacher_is_restricted_to_the_draft_vocabulary_in_mapping_order():
    module = checks.build(Eagle3Module, LLAMA)
    batch = packed_row(random_docs([6, 8], seed=13), 16)
    batch["loss_mask"][0, [0, 1, 6, 7, 8]] = 0  # each document's prompt
    packed = module.prepare_batch(batch)
    teacher = module.teacher_signal(packed)
    output = module.target(packed)
    full = module.target.logits(output.last_hidden_state)
    selected = module.draft.selected_token_ids
    supervised = packed.loss_mask
    assert 0 < int(supervised.sum()) < supervised.numel(), "the test needs positions outside the loss"
    # Logits only at the loss positions, in row-major order; nothing outside is read or computed.
    torch.testing.assert_close(teacher.logits, full[supervised][:, selected])
    torch.testing.assert_close(teacher.logits[teacher.row[supervised]], full[supervised][:, selected])
    assert (teacher.row[~supervised] == -1).all()
    expected_in_vocab = module.draft.t2d[full.argmax(-1)] & supervised
    assert torch.equal(teacher.in_draft_vocab, expected_in_vocab)
    assert teacher.aux_hidden_states.shape == (1, 16, 3 * LLAMA["hidden_size"])
    assert module.target_layer_ids == [1, 3, 4]


def test_out_of_vocabulary_targets_stay_valid_chains_but_leave_the_loss():
    module = checks.build(Eagle3Module, LLAMA, draft_vocab_size=24)
    batch = packed_row(random_docs([9, 12], seed=16), 24)
    packed = module.prepare_batch(batch)
    in_vocab = module.teacher_signal(packed).in_draft_vocab
    assert not in_vocab[packed.loss_mask].all(), (
        "the test needs some greedy targets outside the draft vocabulary"
    )
    with torch.no_grad():
        output = module.compute_loss(batch)
    # valid has no t2d term, correct does: an out-of-vocabulary target is a chain miss, not an exclusion.
    assert int(output.valid_tokens) < int(output.valid.sum())
    assert not (output.correct & ~output.valid).any()
