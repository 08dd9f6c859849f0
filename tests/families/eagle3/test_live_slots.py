"""EAGLE-3 / MLA-EAGLE-3 TTT steps at the live slots only (``ttt_live_slots_only``, the default) against
every slot at every step (the reference, ``ttt_live_slots_only=False``): the same loss, every gradient and
every statistic the module logs (``DraftOutput``: loss, chains, valid tokens, accuracy), on packed and
padded batches with prompts, loss-mask holes, document tails and padding; and the work is really skipped."""

from __future__ import annotations

import pytest
import torch

from lightning_drafts import Eagle3Module, MLAEagle3Module
from lightning_drafts.core.draft_output import DraftOutput
from lightning_drafts.eagle3 import Eagle3Base
from lightning_drafts.eagle3.live_slots import live_slots
from lightning_drafts.eagle3.ttt import TTTSupervision, ttt_supervision
from tests.support.builders import TINY_TARGETS, packed_row, padded_rows, random_docs, stack_rows
from tests.support.eagle3_checks import assert_same_objective, build
from tests.support.output_checks import TOLERANCE, assert_same_output

FAMILIES = [(Eagle3Module, "llama"), (MLAEagle3Module, "deepseek_v3")]
IDS = ["eagle3", "mla_eagle3"]
STEPS = 4
LENGTHS = [14, 9, 3, 12, 6, 10]
# Each document's prompt: longer than the unroll in the long documents, so some prompt slots are dead from
# step 0 on, others come alive only at later steps.
PROMPTS = [7, 2, 0, 6, 1, 8]


def prompted(batch: dict, starts: list[tuple[int, int]]) -> dict:
    for (row, start), prompt, length in zip(starts, PROMPTS, LENGTHS, strict=True):
        batch["loss_mask"][row, start : start + prompt] = 0
        if length > prompt + 3:
            batch["loss_mask"][row, start + prompt + 2] = 0  # a hole inside the answer
    return batch


def packed_batch() -> dict:
    """Three rows with trailing padding; prompts, holes, a document shorter than the unroll."""
    docs = random_docs(LENGTHS, seed=21)
    batch = stack_rows([packed_row(docs[:2], 24), packed_row(docs[2:4], 24), packed_row(docs[4:], 24)])
    return prompted(batch, [(0, 0), (0, 14), (1, 0), (1, 3), (2, 0), (2, 6)])


def padded_batch() -> dict:
    return prompted(padded_rows(random_docs(LENGTHS, seed=21), 16), [(doc, 0) for doc in range(len(LENGTHS))])


def padded_with_an_empty_row() -> dict:
    """The padded rows plus a row of padding only (no real token, nothing supervised)."""
    batch = padded_batch()
    return {
        key: torch.cat([value[:2], torch.zeros_like(value[:1]), value[2:]]) for key, value in batch.items()
    }


def row_without_live_slots() -> dict:
    """The packed rows plus a row of real tokens without any supervision: none of its slots is live."""
    batch = packed_batch()
    silent = packed_row(random_docs([11, 9], seed=22), 24)
    silent["loss_mask"].zero_()
    return stack_rows([{k: v[:1] for k, v in batch.items()}, silent, {k: v[1:] for k, v in batch.items()}])


def everything_supervised() -> dict:
    """Rows filled by documents supervised at every token, no padding: every slot that can be live is."""
    docs = random_docs([9, 7, 16, 5, 11], seed=23)
    return stack_rows([packed_row(docs[:2], 16), packed_row(docs[2:3], 16), packed_row(docs[3:], 16)])


def supervision_ends_early() -> dict:
    """Documents of at most 3 tokens: nothing is supervised past step 1, so the unroll stops there."""
    return stack_rows(
        [packed_row(random_docs([3, 2, 3], seed=24), 8), packed_row(random_docs([3], seed=25), 8)]
    )


def nothing_supervised() -> dict:
    batch = packed_batch()
    batch["loss_mask"].zero_()
    return batch


BATCHES = {
    "packed": packed_batch,
    "padded": padded_batch,
    "row-without-live-slots": row_without_live_slots,
    "padded-with-an-empty-row": padded_with_an_empty_row,
    "everything-supervised": everything_supervised,
    "supervision-ends-early": supervision_ends_early,
    "nothing-supervised": nothing_supervised,
}


def pair(module_class: type[Eagle3Base], family: str, **options) -> tuple[Eagle3Base, Eagle3Base]:
    """The module (live slots) and its reference (every slot) with the same weights."""
    live = build(module_class, TINY_TARGETS[family], ttt_length=STEPS, **options)
    every = build(module_class, TINY_TARGETS[family], ttt_length=STEPS, ttt_live_slots_only=False, **options)
    every.load_state_dict(live.state_dict())
    assert live.hparams.ttt_live_slots_only and not every.hparams.ttt_live_slots_only
    return live, every


def run(module: Eagle3Base, batch: dict) -> tuple[DraftOutput, dict[str, torch.Tensor]]:
    module.zero_grad(set_to_none=True)
    output = module.compute_loss(batch)
    output.loss.backward()
    return output, {name: p.grad for name, p in module.draft.named_parameters() if p.requires_grad}


# Every batch on the default objective and CPU kernel; the dense reference kernel and the LK objectives on
# the batches that mix live and dead slots in one layout or the other.
VARIANTS = [("sdpa", None, name) for name in BATCHES] + [
    (backend, lk_loss_type, name)
    for backend, lk_loss_type in (("eager", None), ("sdpa", "alpha"), ("sdpa", "lambda"))
    for name in ("packed", "padded", "row-without-live-slots")
]


@pytest.mark.parametrize("backend, lk_loss_type, batch_name", VARIANTS)
@pytest.mark.parametrize("module_class, family", FAMILIES, ids=IDS)
def test_live_slots_give_the_loss_gradients_and_statistics_of_every_slot(
    module_class, family, backend, lk_loss_type, batch_name
):
    options = {"draft_attn_backend": backend, "lk_loss_type": lk_loss_type}
    if batch_name == "everything-supervised":
        # The full vocabulary: every greedy target token is supervised, so no slot leaves the loss.
        options |= {"draft_vocab_size": None, "token_frequencies": None}
    live, every = pair(module_class, family, **options)
    batch = BATCHES[batch_name]()
    (a, grads_a), (b, grads_b) = run(live, batch), run(every, batch)
    assert_same_output(a, b)
    assert grads_a.keys() == grads_b.keys() and len(grads_a) > 5
    for name, grad in grads_b.items():
        # Every weight gets a gradient on both paths, a zero one when nothing is supervised.
        assert grads_a[name] is not None and grad is not None, name
        torch.testing.assert_close(grads_a[name], grad, **TOLERANCE, msg=lambda m, n=name: f"{n}: {m}")
    if batch_name == "nothing-supervised":
        assert int(a.valid_tokens) == 0 and float(a.loss.detach()) == 0.0
    else:
        assert int(a.valid_tokens) > 0 and any(g.abs().sum() > 0 for g in grads_a.values())


@pytest.mark.parametrize("module_class, family", FAMILIES, ids=IDS)
def test_the_batches_drop_out_of_vocabulary_targets_and_prompt_slots(module_class, family):
    """The cases the comparison is about are really there: supervised positions whose greedy teacher
    token the 48-id draft vocabulary cannot predict (chain misses outside the loss), and slots that are
    live at step 0 but not at the last step."""
    live, _ = pair(module_class, family)
    for name in ("packed", "padded", "row-without-live-slots", "padded-with-an-empty-row"):
        packed = live.prepare_batch(BATCHES[name]())
        teacher = live.teacher_signal(packed)
        out_of_vocab = packed.loss_mask & ~teacher.in_draft_vocab
        assert 0 < int(out_of_vocab.sum()) < int(packed.loss_mask.sum()), name
        sets = live_slots(ttt_supervision(packed, teacher, STEPS))
        assert sets[-1].numel() < sets[0].numel() < packed.input_ids.numel() / 2, name


@pytest.mark.parametrize("lk_loss_type", [None, "lambda"])
@pytest.mark.parametrize("module_class, family", FAMILIES, ids=IDS)
def test_packed_equals_padded_with_live_slots(module_class, family, lk_loss_type):
    live, _ = pair(module_class, family, lk_loss_type=lk_loss_type)
    assert_same_objective(live, packed_batch(), padded_batch())


@pytest.mark.parametrize("module_class, family", FAMILIES, ids=IDS)
def test_flex_block_masks_of_live_slots_give_the_dense_results(module_class, family):
    """The GPU path's masks, run by eager flex attention on CPU (forward only: CPU flex has no backward)."""
    flex, every = pair(module_class, family, draft_attn_backend="flex")
    dense, _ = pair(module_class, family, draft_attn_backend="sdpa")
    dense.load_state_dict(flex.state_dict())
    with torch.no_grad():
        for batch in (packed_batch(), padded_batch(), row_without_live_slots()):
            reference = dense.compute_loss(batch)
            assert_same_output(flex.compute_loss(batch), reference)
            assert_same_output(every.compute_loss(batch), reference)


def test_each_step_runs_its_live_slots_only_and_step_zero_keeps_every_key():
    live, _ = pair(Eagle3Module, "llama")
    batch = row_without_live_slots()
    packed = live.prepare_batch(batch)
    slots = packed.input_ids.numel()
    expected = [s.numel() for s in live_slots(ttt_supervision(packed, live.teacher_signal(packed), STEPS))]
    attention = live.draft.midlayer.self_attn
    widths: dict[str, list[int]] = {"mlp": [], "k_proj": [], "q_proj": []}
    hooks = [
        module.register_forward_hook(
            lambda m, args, out, name=name: widths[name].append(args[0].shape[:-1].numel())
        )
        for name, module in (
            ("mlp", live.draft.midlayer.mlp),
            ("k_proj", attention.k_proj),
            ("q_proj", attention.q_proj),
        )
    ]
    try:
        live.compute_loss(batch)
    finally:
        for hook in hooks:
            hook.remove()
    assert widths["mlp"] == widths["q_proj"] == expected
    assert widths["k_proj"] == [slots, *expected[1:]]
    # Shrinking sets, a fraction of the batch: the prompts, the silent row, tails and padding are dropped.
    assert all(later <= earlier for earlier, later in zip(expected, expected[1:], strict=False))
    assert expected[0] < slots / 2 and expected[-1] < expected[0]


def test_live_sets_are_the_suffix_unions_of_the_supervised_slots():
    gen = torch.Generator().manual_seed(0)
    supervised = torch.rand(5, 3, 7, generator=gen) < 0.2
    chain_valid = supervised | (torch.rand(5, 3, 7, generator=gen) < 0.2)
    supervision = TTTSupervision(chain_valid, supervised)
    sizes = supervision.sizes
    sets = live_slots(supervision)
    assert sizes.live == [int(supervised[step:].any(0).sum()) for step in range(5)]
    assert sizes.supervised == supervised.reshape(5, -1).sum(1).tolist()
    assert sizes.chains == int(chain_valid.any(0).sum())
    for step, slots in enumerate(sets):
        expected = supervised[step:].any(0).reshape(-1).nonzero().squeeze(1)
        assert torch.equal(slots, expected)
    assert all(
        set(later.tolist()) <= set(earlier.tolist()) for earlier, later in zip(sets, sets[1:], strict=False)
    )
    nothing = torch.zeros(3, 2, 4, dtype=torch.bool)
    assert [s.numel() for s in live_slots(TTTSupervision(nothing, nothing))] == [0, 0, 0]


def test_the_option_is_a_bool():
    with pytest.raises(ValueError, match="ttt_live_slots_only = 1; it must be True or False"):
        Eagle3Module(TINY_TARGETS["llama"], ttt_live_slots_only=1)
