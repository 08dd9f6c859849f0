"""The target matrix: every architecture drafts are trained for (tests/support/target_matrix.py), on every CPU
attention path of the frozen target, keeps packed documents apart exactly as the model computes each document
alone (sliding windows, chunks, attention sinks, linear-attention state, MoE routing), or refuses the target
in one line naming the layer kind and the path that can; every draft family trains a step on each."""

from __future__ import annotations

import re

import pytest
import torch
from transformers import AutoConfig

from lightning_drafts.core.batch import validate_batch
from lightning_drafts.training.auto_model import target_model_class
from lightning_drafts.training.target import COMPACT_ROW_MULTIPLE, FrozenTarget
from tests.families.cases import CASES
from tests.support.builders import packed_row, random_docs
from tests.support.target_matrix import (
    ARCHITECTURES,
    FAMILY_REFUSAL,
    LAYERS,
    REFUSED,
    TESTED,
    config,
    family_trains,
    first_path,
)

# Tiny models: a second thread only adds synchronisation to each small matmul.
pytestmark = pytest.mark.usefixtures("one_thread")

LAYER_IDS = tuple(range(LAYERS))
# Three documents longer than the window / chunk (tests.support.target_matrix.WINDOW), in a row with padding after.
LENGTHS = (7, 9, 6)
WIDTH = 26
# float32 against a float64 evaluation of the same model: each layer runs about six reductions (norm, q/k/v,
# scores, attention-weighted values, o_proj, MLP up and down) of at most 64 terms, each within
# 2 * n * u = 7.6e-6 of the row's magnitude (tests.support.float_bounds.reduction_bound); over the layers and the
# final norm that is 1.4e-4 of the largest feature of the token. A document that reads another one, or a
# window not applied, moves its features by a tenth of their size or more.
ROUNDING = (LAYERS + 1) * 6 * 2 * 64 * torch.finfo(torch.float32).eps / 2
MOE = {"deepseek_v3", "gpt_oss", "qwen3_moe", "qwen3_next", "glm4_moe", "llama4", "kimi_linear"}
# Targets that run each document in a forward of its own (linear attention): nothing of the row reaches one.
ALONE = {"qwen3_next", "qwen3_5", "kimi_linear"}


def features(target: FrozenTarget, row: dict) -> list[torch.Tensor]:
    """Each layer's output and the final state of ``row``'s one packed row, ``[T, H]`` each."""
    out = target(validate_batch(row, vocab_size=target.vocab_size), LAYER_IDS)
    return [state[0] for state in (*out.hidden_states, out.last_hidden_state)]


@pytest.fixture(scope="module")
def references() -> dict[str, torch.nn.Module]:
    """Each architecture's model (the target's weights) in float64 with transformers' eager attention: its own
    masks, windows, chunks, sinks and recurrent state, on a document alone."""
    built = {}

    def reference(architecture: str) -> torch.nn.Module:
        if architecture not in built:
            fields = config(architecture)
            model_config = AutoConfig.for_model(fields.pop("model_type"), **fields)
            # build_causal_lm's seeding, so the weights are the target's; the experts as plain matmuls (the
            # grouped kernel takes no float64).
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(0)
                model = target_model_class(model_config).from_config(
                    model_config, attn_implementation="eager", experts_implementation="eager"
                )
            built[architecture] = model.double().eval()
        return built[architecture]

    return reference


@torch.no_grad()
def alone(model: torch.nn.Module, document: torch.Tensor) -> list[torch.Tensor]:
    states = model(input_ids=document[None], output_hidden_states=True, use_cache=False).hidden_states
    # hidden_states[i + 1] is layer i's output; the last one is the final norm's.
    return [states[i + 1][0] for i in LAYER_IDS[:-1]] + [states[-1][0]]


@pytest.mark.parametrize(("architecture", "path"), TESTED)
def test_packed_features_equal_each_document_alone(architecture, path, references):
    target = FrozenTarget(config(architecture), attn_backend=path)
    documents = random_docs(list(LENGTHS), seed=3)
    packed = features(target, packed_row(documents, WIDTH))
    start = 0
    for document in documents:
        span = slice(start, start + len(document))
        # The last captured layer is the last layer, whose output the final norm reads: compared through it.
        for layer, (got, expected) in enumerate(
            zip([*packed[:-2], packed[-1]], alone(references(architecture), document), strict=True)
        ):
            expected = expected.float()
            bound = ROUNDING * expected.abs().amax(dim=-1, keepdim=True)
            error = (got[span] - expected).abs()
            assert (error <= bound).all(), (
                f"{architecture} via {path}: document at {start} differs from it alone at output {layer} by "
                f"{float(error.max()):.3g} (bound {float(bound.max()):.3g})"
            )
        start += len(document)


@pytest.mark.parametrize(("architecture", "path"), TESTED)
def test_a_documents_features_do_not_change_with_the_documents_beside_it(architecture, path):
    # Same place in the row, other neighbours before and after it: a window, chunk or recurrent state that
    # runs along the row, or a router that sees the row, changes it. Dense targets run the same arithmetic
    # on the same values: bit for bit. A MoE expert multiplies the tokens routed to it, whose count the
    # neighbours change, and a CPU matmul may round a row differently in a taller product.
    target = FrozenTarget(config(architecture), attn_backend=path)
    before, middle, after = random_docs(list(LENGTHS), seed=5)
    other_before, other_after = random_docs([LENGTHS[0], LENGTHS[2] + 2], seed=6)
    first = features(target, packed_row([before, middle, after], WIDTH))
    second = features(target, packed_row([other_before, middle, other_after], WIDTH))
    span = slice(len(before), len(before) + len(middle))
    # A target with linear-attention layers runs each document in a forward of its own: nothing of the row
    # reaches it.
    exact = architecture not in MOE or architecture in ALONE
    for got, expected in zip(second, first, strict=True):
        if not exact:
            bound = 2 * ROUNDING * expected[span].abs().amax(dim=-1, keepdim=True)
            assert ((got[span] - expected[span]).abs() <= bound).all(), f"{architecture} via {path}"
        else:
            assert torch.equal(got[span], expected[span]), f"{architecture} via {path}"


@pytest.mark.parametrize(("architecture", "path"), sorted(REFUSED))
def test_a_path_that_cannot_isolate_a_targets_layers_refuses_it_in_one_line(architecture, path):
    target = FrozenTarget(config(architecture), attn_backend=path)
    row = validate_batch(packed_row(random_docs(list(LENGTHS), seed=3), WIDTH), vocab_size=target.vocab_size)
    with pytest.raises(ValueError) as refused:
        target(row, LAYER_IDS)
    assert str(refused.value) == REFUSED[architecture, path]


@pytest.mark.parametrize(
    ("backend", "device", "refusal"),
    [
        ("flash", "cuda", "attention sinks are dropped by flash-attn varlen"),
        ("flex", "cpu", "attention sinks do not run in flex attention on the CPU"),
    ],
)
def test_every_path_refuses_attention_sinks_its_kernel_drops(backend, device, refusal):
    # Checked before any path runs (the masked ones and one document per forward alike); the CUDA path is
    # reached on a GPU only, and the guard needs nothing of the device but its type.
    target = FrozenTarget(config("gpt_oss"))
    with pytest.raises(ValueError, match=re.escape(refusal)):
        target._refuse_dropped_sinks(backend, torch.device(device))
    target._refuse_dropped_sinks("flex", torch.device("cuda"))
    FrozenTarget(config("llama"))._refuse_dropped_sinks(backend, torch.device(device))


@pytest.mark.parametrize("path", ["sdpa", "eager"])
def test_a_linear_attention_target_runs_one_forward_per_document_on_every_path(path):
    # The backend only picks the full-attention layers' kernel: on CUDA (flash, sdpa) the same per-document
    # forwards run, so a Gated DeltaNet never sees two documents in one call. Counted at the decoder, with
    # the lengths each call ran (its document's, filled to the compact width).
    target = FrozenTarget(config("qwen3_next"), attn_backend=path)
    row = packed_row(random_docs(list(LENGTHS), seed=3), WIDTH)
    widths = []
    hook = target.decoder.register_forward_pre_hook(
        lambda module, args, kwargs: widths.append(kwargs["input_ids"].shape[1]), with_kwargs=True
    )
    try:
        features(target, row)
    finally:
        hook.remove()
    assert widths == [COMPACT_ROW_MULTIPLE] * len(LENGTHS)


def family_cells() -> list:
    """``(module class, case, architecture)`` for every draft class the library ships (the probe family left
    out) and every architecture."""
    return [
        pytest.param(module_class, case, architecture, id=f"{module_class.__name__}-{architecture}")
        for module_class, case in CASES.items()
        if not module_class.__module__.startswith("tests.")
        for architecture in ARCHITECTURES
    ]


@pytest.mark.parametrize(("module_class", "case", "architecture"), family_cells())
def test_every_family_trains_a_step_on_every_target(module_class, case, architecture):
    if not family_trains(module_class.__name__, architecture):
        with pytest.raises(ValueError, match=FAMILY_REFUSAL[module_class.__name__]):
            case.build(config(architecture), target_layer_ids=list(LAYER_IDS))
        return
    path = first_path(architecture)
    if path is None:
        # No path runs the target: the family's step meets the eager path's refusal.
        module = case.build(
            config(architecture), target_layer_ids=list(LAYER_IDS), target_attn_backend="eager"
        )
        batch = packed_row(random_docs([7, 9], seed=5, vocab=case.vocab), 20)
        with pytest.raises(ValueError) as refused:
            module.compute_loss(batch, **case.loss_inputs(module, batch, 0))
        assert str(refused.value) == REFUSED[architecture, "eager"]
        return
    options = {"target_layer_ids": list(LAYER_IDS), "target_attn_backend": path}
    module = case.build(config(architecture), **options)
    batch = packed_row(random_docs([7, 9], seed=5, vocab=case.vocab), 20)
    module.zero_grad(set_to_none=True)
    loss = module.compute_loss(batch, **case.loss_inputs(module, batch, 0)).loss
    loss.backward()
    trainable = [p for p in module.parameters() if p.requires_grad]
    assert torch.isfinite(loss) and trainable
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in trainable)
    assert any(p.grad.abs().sum() > 0 for p in trainable)
