"""FrozenTarget: packed documents are isolated, packed == padded, captures match HF hidden states."""

from __future__ import annotations

import pytest
import torch

from lightning_drafts.core.batch import validate_batch
from lightning_drafts.training.target import FrozenTarget, default_capture_layers
from tests.support.builders import TINY_TARGETS, layers_run, packed_row, padded_rows, random_docs, stack_rows

CPU_BACKENDS = ("sdpa", "eager", "flex")
LAYERS = (1, 3, 6)


def tolerance(config: dict) -> dict:
    # MoE expert matmuls see a different token batch when another document changes.
    return (
        {"atol": 1e-5, "rtol": 1e-5} if config["model_type"] == "deepseek_v3" else {"atol": 0.0, "rtol": 0.0}
    )


def run(target: FrozenTarget, batch: dict) -> tuple[list[torch.Tensor], torch.Tensor]:
    packed = validate_batch(batch, vocab_size=target.vocab_size)
    out = target(packed, LAYERS)
    return list(out.hidden_states), target.logits(out.last_hidden_state)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_perturbing_one_document_leaves_the_others_untouched(target_config, backend):
    target = FrozenTarget(target_config, attn_backend=backend)
    a, b, c = random_docs([5, 7, 9])
    batch = stack_rows([packed_row([a, b], 16), packed_row([c], 16)])
    perturbed = {k: v.clone() for k, v in batch.items()}
    perturbed["input_ids"][0, 5:12] = (perturbed["input_ids"][0, 5:12] + 1) % target.vocab_size

    hidden, logits = run(target, batch)
    hidden_p, logits_p = run(target, perturbed)

    tol = tolerance(target_config)
    for h, hp in zip(hidden, hidden_p, strict=True):
        torch.testing.assert_close(hp[0, :5], h[0, :5], **tol)
        torch.testing.assert_close(hp[1, :9], h[1, :9], **tol)
        assert not torch.allclose(hp[0, 5:12], h[0, 5:12])
    torch.testing.assert_close(logits_p[0, :5], logits[0, :5], **tol)
    assert not torch.allclose(logits_p[0, 5:12], logits[0, 5:12])


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_packed_row_equals_padded_rows(target_config, backend):
    target = FrozenTarget(target_config, attn_backend=backend)
    docs = random_docs([6, 4, 9], seed=1)
    packed_hidden, packed_logits = run(target, packed_row(docs, 24))
    padded_hidden, padded_logits = run(target, padded_rows(docs, 12))

    starts = [0, 6, 10]
    for row, (start, doc) in enumerate(zip(starts, docs, strict=True)):
        span = slice(start, start + len(doc))
        for hp, hd in zip(packed_hidden, padded_hidden, strict=True):
            torch.testing.assert_close(hp[0, span], hd[row, : len(doc)], atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(
            packed_logits[0, span], padded_logits[row, : len(doc)], atol=2e-5, rtol=1e-4
        )


def test_the_flex_target_equals_the_sdpa_target(target_config):
    """Flex (a mask_mod over the packed row) against SDPA's per-document causal kernel: two mechanisms, one
    answer, so a flex mask or kernel that packed == padded cannot see (both layouts share it) shows here."""
    batch = packed_row(random_docs([6, 4, 9], seed=1), 24)
    flex_hidden, flex_logits = run(FrozenTarget(target_config, attn_backend="flex"), batch)
    sdpa_hidden, sdpa_logits = run(FrozenTarget(target_config, attn_backend="sdpa"), batch)
    for flex, sdpa in zip(flex_hidden, sdpa_hidden, strict=True):
        torch.testing.assert_close(flex[0, :19], sdpa[0, :19], atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(flex_logits[0, :19], sdpa_logits[0, :19], atol=2e-5, rtol=1e-4)


def test_the_cpu_flex_target_compiles_nothing():
    """transformers compiles flex itself, and torch 2.13's CPU flex kernel miscomputed small rows on an AVX2
    machine (the test above failed there with NaN): on the CPU the target's flex forward runs eager, so no
    compile happens (a compile under this stance raises)."""
    target = FrozenTarget(TINY_TARGETS["llama"], attn_backend="flex")
    torch._dynamo.reset()
    with torch.compiler.set_stance("fail_on_recompile"):
        run(target, packed_row(random_docs([6, 4, 9], seed=1), 24))


def test_captured_layers_are_hf_layer_outputs(target_config):
    target = FrozenTarget(target_config, attn_backend="sdpa")
    ids = random_docs([10], seed=2)[0][None]
    hidden, logits = run(target, {"input_ids": ids})
    reference = target.model(input_ids=ids, output_hidden_states=True, use_cache=False)
    for layer, captured in zip(LAYERS, hidden, strict=True):
        torch.testing.assert_close(captured, reference.hidden_states[layer + 1])
    torch.testing.assert_close(logits, reference.logits)


# 300: past two of row_max's 128-column blocks, with a tail after the last whole one.
@pytest.mark.parametrize("vocab", [96, 300])
def test_restricted_logits_and_chunked_greedy_tokens_match_full_vocabulary(vocab):
    target = FrozenTarget({**TINY_TARGETS["qwen3"], "vocab_size": vocab})
    packed = validate_batch({"input_ids": random_docs([12], seed=3)[0][None]})
    last = target(packed).last_hidden_state
    full = target.logits(last)
    vocab_ids = torch.tensor([5, 1, 40, 7])
    torch.testing.assert_close(target.logits(last, vocab_ids), full[..., vocab_ids])
    assert torch.equal(target.greedy_tokens(last, chunk_tokens=5), full.argmax(-1))


def test_target_is_frozen_and_computes_in_eval_mode_in_a_training_module_tree():
    # Dropout that would change every hidden state if the target ran in train mode.
    target = FrozenTarget({**TINY_TARGETS["llama"], "attention_dropout": 0.5})
    packed = validate_batch({"input_ids": random_docs([8])[0][None]})
    target.eval()
    reference = target(packed, LAYERS)
    target.train()
    # Lightning warns about modules it finds in eval mode when fit starts: the tree follows its owner.
    assert all(module.training for module in target.modules())
    out = target(packed, LAYERS)
    assert torch.equal(out.last_hidden_state, reference.last_hidden_state)
    assert all(module.training for module in target.modules())
    assert not any(p.requires_grad for p in target.parameters())
    assert not out.last_hidden_state.requires_grad


def test_config_dict_targets_are_seeded():
    first = FrozenTarget(TINY_TARGETS["llama"], seed=3).model.state_dict()
    second = FrozenTarget(TINY_TARGETS["llama"], seed=3).model.state_dict()
    other = FrozenTarget(TINY_TARGETS["llama"], seed=4).model.state_dict()
    assert all(torch.equal(first[k], second[k]) for k in first)
    assert not all(torch.equal(first[k], other[k]) for k in first)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"model": {"vocab_size": 8}}, "model_type"),
        ({"model": 3}, "PreTrainedModel"),
        ({"model": TINY_TARGETS["llama"], "attn_backend": "xformers"}, "xformers"),
        ({"model": TINY_TARGETS["llama"], "dtype": "float99"}, "float99"),
    ],
)
def test_bad_target_arguments_fail_loud(kwargs, match):
    with pytest.raises(ValueError, match=match):
        FrozenTarget(**kwargs)


def test_out_of_range_layer_ids_fail_loud():
    target = FrozenTarget(TINY_TARGETS["llama"])
    with pytest.raises(ValueError, match=r"\[8\]"):
        target(validate_batch({"input_ids": random_docs([4])[0][None]}), [1, 8])


def test_flash_backend_refused_without_flash_attn_on_cuda():
    target = FrozenTarget(TINY_TARGETS["llama"], attn_backend="flash")
    with pytest.raises(ValueError, match="flash-attn"):
        target(validate_batch({"input_ids": random_docs([4])[0][None]}))


def test_default_capture_layers():
    assert default_capture_layers(16) == [1, 7, 12]
    assert default_capture_layers(61) == [1, 29, 57]
    with pytest.raises(ValueError, match="too shallow"):
        default_capture_layers(6)


def test_the_state_dict_leaves_out_the_whole_target_and_loading_neither_asks_for_nor_takes_it():
    """No checkpoint holds the target, so a save must never visit (gather, copy) any of it: the module's
    state dict holds the draft only; the wrapped model's own state dict is whole; a draft-only state dict
    loads strictly, one missing a draft key does not; a state dict that still holds target keys (a checkpoint
    written before they were left out) loads its draft and leaves the target's weights as built."""
    from tests.support.probe_draft import NextTokenProbe

    module = NextTokenProbe(TINY_TARGETS["llama"])
    assert sorted(module.state_dict()) == ["head.bias", "head.weight"]
    assert any(".layers." in k for k in module.target.model.state_dict())
    draft = {k: v.clone() + 1 for k, v in module.draft_state_dict().items()}
    module.load_state_dict(draft)
    assert torch.equal(module.head.weight, draft["head.weight"])
    with pytest.raises(RuntimeError, match="missing keys.*head.bias"):
        module.load_state_dict({"head.weight": draft["head.weight"]})
    module.load_state_dict({"head.weight": draft["head.weight"]}, strict=False)

    built = {k: v.clone() for k, v in module.target.model.state_dict().items()}
    old = {f"target.model.{k}": v + 1 for k, v in built.items()}
    module.load_state_dict({**old, **{k: v + 1 for k, v in draft.items()}})
    assert torch.equal(module.head.weight, draft["head.weight"] + 1)
    for name, value in module.target.model.state_dict().items():
        assert torch.equal(value, built[name]), name


def test_sdpa_on_the_cpu_attends_per_document_and_equals_each_document_alone(target_config):
    from lightning_drafts.training.document_target_attention import DOCUMENT_ATTENTION

    target = FrozenTarget(target_config, attn_backend="sdpa")
    docs = random_docs([30, 3, 41, 17], seed=4)
    seen = []
    hook = target.decoder_layers[0].self_attn.register_forward_pre_hook(
        lambda module, args: seen.append(module.config._attn_implementation)
    )
    hidden, _ = run(target, packed_row(docs, 100))
    hook.remove()
    assert seen == [DOCUMENT_ATTENTION]
    # Every other caller of the model keeps transformers' SDPA, masks and cache included.
    assert target.model.config._attn_implementation == "sdpa"
    start = 0
    for doc in docs:
        alone = target.model(input_ids=doc[None], output_hidden_states=True, use_cache=False).hidden_states
        for layer, h in zip(LAYERS, hidden, strict=True):
            torch.testing.assert_close(
                h[0, start : start + len(doc)], alone[layer + 1][0], atol=2e-5, rtol=1e-4
            )
        start += len(doc)


def test_sdpa_on_the_cpu_runs_the_layers_over_the_real_tokens_alone(target_config):
    from lightning_drafts.training.target import COMPACT_ROW_MULTIPLE

    target = FrozenTarget(target_config, attn_backend="sdpa")
    rows = [random_docs([30, 3, 41], seed=12), random_docs([17], seed=13)]
    shapes = []
    hook = target.decoder_layers[0].register_forward_pre_hook(
        lambda module, args, kwargs: shapes.append(tuple((args or (kwargs["hidden_states"],))[0].shape[:2])),
        with_kwargs=True,
    )
    hidden, _ = run(target, stack_rows([packed_row(docs, 100) for docs in rows]))
    hook.remove()
    # 91 real tokens of 200, in one row filled up to the next multiple.
    assert COMPACT_ROW_MULTIPLE == 64 and shapes == [(1, 128)]
    for row, docs in enumerate(rows):
        start = 0
        for doc in docs:
            alone = target.model(
                input_ids=doc[None], output_hidden_states=True, use_cache=False
            ).hidden_states
            for layer, h in zip(LAYERS, hidden, strict=True):
                torch.testing.assert_close(
                    h[row, start : start + len(doc)], alone[layer + 1][0], atol=2e-5, rtol=1e-4
                )
            start += len(doc)
        for h in hidden:
            assert not h[row, start:].any()


def test_a_documents_features_are_the_same_wherever_it_is_packed(target_config):
    # Its attention reads the document alone: neither the documents beside it nor its offset in the row
    # change a bit of it (the linear layers see tall rows of real tokens either way).
    target = FrozenTarget(target_config, attn_backend="sdpa")
    doc = random_docs([300], seed=9)[0]
    before, after = random_docs([200], seed=10)[0], random_docs([80, 50], seed=11)
    first_hidden, first_logits = run(target, packed_row([doc, *after], 512))
    moved_hidden, moved_logits = run(target, packed_row([before, doc], 512))
    tol = tolerance(target_config)
    span = slice(200, 200 + len(doc))
    for first, moved in zip(first_hidden, moved_hidden, strict=True):
        torch.testing.assert_close(moved[0, span], first[0, : len(doc)], **tol)
    torch.testing.assert_close(moved_logits[0, span], first_logits[0, : len(doc)], **tol)


def test_the_document_attention_refuses_a_forward_without_its_spans(target_config):
    from lightning_drafts.training.document_target_attention import DOCUMENT_ATTENTION

    target = FrozenTarget(target_config, attn_backend="sdpa")
    target.model.set_attn_implementation(DOCUMENT_ATTENTION)
    with pytest.raises(ValueError, match="needs the \\(row, start, stop\\) span of every document"):
        target.model(input_ids=torch.tensor([[5, 6, 7]]), use_cache=False)


def test_a_rows_features_do_not_depend_on_the_rows_batched_with_it(target_config):
    # A capture batches rows otherwise than the fit that trains or validates on them, and float32 features
    # must be the online ones exactly.
    target = FrozenTarget(target_config, attn_backend="sdpa")
    long_doc = random_docs([600], seed=5)
    short_docs = random_docs([200, 100, 300], seed=6)
    row = packed_row(short_docs, 600)
    alone_hidden, alone_logits = run(target, row)
    batched_hidden, batched_logits = run(target, stack_rows([packed_row(long_doc, 600), row]))
    tol = tolerance(target_config)
    for alone, batched in zip(alone_hidden, batched_hidden, strict=True):
        torch.testing.assert_close(batched[1], alone[0], **tol)
    torch.testing.assert_close(batched_logits[1], alone_logits[0], **tol)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_a_forward_without_the_final_state_stops_at_the_deepest_captured_layer(target_config, backend):
    target = FrozenTarget(target_config, attn_backend=backend)
    packed = validate_batch(packed_row(random_docs([9, 14], seed=8), 28), vocab_size=target.vocab_size)
    ran, hooks = layers_run(target)
    whole = target(packed, (1, 3))
    assert ran == list(range(target.num_layers))
    ran.clear()
    partial = target(packed, (3, 1), final=False)
    assert ran == [0, 1, 2, 3]
    # The same layers computed the same way: the captured outputs are the whole forward's, bit for bit.
    for layer, state in zip((3, 1), partial.hidden_states, strict=True):
        assert torch.equal(state, whole.hidden_states[(1, 3).index(layer)])
    assert partial.last_hidden_state.shape == (*packed.shape, 0)
    with pytest.raises(ValueError, match="fewer positions than this draft reads"):
        partial.final_states((slice(None), slice(None)))
    # The decoder is whole again for every later caller.
    ran.clear()
    target(packed, (1,))
    assert ran == list(range(target.num_layers))
    for hook in hooks:
        hook.remove()
