"""Serving-faithful evaluation (issue 9) of DSpark: greedy speculative decoding from the exported files of
both layouts (one block of K proposals per round, the Markov head walked greedily), the export validator,
and the served block against the training module's."""

from __future__ import annotations

import json
from collections.abc import Callable

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader

from lightning_drafts import DFlash2Module, DFlashModule, DSparkModule
from lightning_drafts.attention.block_masks import block_layout
from lightning_drafts.callbacks import ServedAcceptanceCallback
from lightning_drafts.core.batch import validate_batch
from lightning_drafts.dspark.context_features import capture_context_features
from lightning_drafts.dspark.eval_mask import block_supervision
from lightning_drafts.dspark.speculate import DSparkSpeculator, load_speculator, load_training_module
from lightning_drafts.serving.decode import greedy_generate
from lightning_drafts.serving.family import Speculator, VerifiedPrefix
from lightning_drafts.workflows.evaluate import evaluate_export
from lightning_drafts.workflows.export import validate_export
from tests.block_draft_cases import perturb
from tests.builders import TINY_TARGETS, VOCAB, PromptRows, assert_target_greedy, random_docs, rewrite_export
from tests.families.dflash.test_evaluate_dflash import (
    EOS,
    LAST_LAYER,
    MASK,
    cli_evaluate,
    one_thread,  # noqa: F401  (the autouse fixture: one thread for hundreds of tiny forwards)
    qwen3_target_file,
    repeated_prompts,
    repeating_target,
    sharpened_target,
    training_batch,
)
from tests.families.dflash.test_evaluate_dflash import trained_module as dflash_trained_module

BLOCK = 4
RANK = 8
MAX_ACCEPT = BLOCK + 1  # slot k proposes anchor + k + 1: K proposals, plus the target's bonus token
LAYOUTS = ["specforge", "nemo"]
# The last id is the target's final-norm output, so shifting the ids by one leaves the target.
TRAINED_LAYERS = [3, LAST_LAYER]

pytestmark = pytest.mark.filterwarnings("ignore:target_layer_ids .* standard SGLang captures")


# --- builders -----------------------------------------------------------------------------------------


def make(target, **kwargs) -> DSparkModule:
    torch.manual_seed(0)
    return DSparkModule(
        target,
        mask_token_id=MASK,
        num_draft_layers=kwargs.pop("num_draft_layers", 2),
        block_size=BLOCK,
        num_anchors=4,
        markov_rank=kwargs.pop("markov_rank", RANK),
        target_layer_ids=kwargs.pop("target_layer_ids", TRAINED_LAYERS),
        draft_attn_backend="sdpa",
        target_attn_backend="sdpa",
        **kwargs,
    )


def trained_module(steps: int = 4, target=None) -> DSparkModule:
    """A draft trained a few optimizer steps on a fixed batch (export, not quality, is under test)."""
    module = make(sharpened_target() if target is None else target)
    batch = training_batch()
    optimizer = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(steps):
        optimizer.zero_grad()
        module.compute_loss(batch).loss.backward()
        optimizer.step()
    return module


def perfect_module() -> DSparkModule:
    """A one-layer DSpark draft whose every slot, Markov head included, predicts what the target predicts.

    Construction (target: ``repeating_target`` of the DFlash tests, whose greedy output repeats its last
    token and whose mask-token embedding row is zero; prompts: one token ``a`` repeated, so every context
    position carries the same target features and the continuation is ``a a a ...``):

    * ``fc`` selects the chunk of feature ``L - 1``, the target's **final-norm output**, which the
      target's LM head turns into ``a``; ``v_proj`` / ``o_proj`` are the identity (4 KV heads);
    * ``k_norm`` is zero, so attention is uniform: every slot averages the context values (along
      ``hidden_norm(final_norm(a))``), the anchor slot's value (along ``a``'s embedding row) and the mask
      slots' values (zero: the mask token's embedding row is zero); the anchor slot also keeps its own
      embedding in the residual stream; ``post_attention_layernorm`` is zero, so the MLP adds nothing;
    * so every slot's backbone logits (through the target's LM head, a row-normalised embedding) peak
      at ``a``; the Markov head is a "repeat the previous token" bigram, ``W1 = W2 = U`` with unit rows
      ``U``, whose bias ``U U[prev]`` peaks at ``prev``; the walk's previous token is ``a`` at every slot;
    * the confidence head's bias is moved off its 0 initialisation (a confident draft).

    A draft served with the right mask token therefore proposes ``a`` at all K slots and reaches K + 1.
    """
    target = repeating_target()
    module = make(target, num_draft_layers=1, draft_overrides={"num_key_value_heads": 4})
    draft, hidden = module.draft, module.draft.fc.weight.shape[0]
    layer = draft.layers[0]
    generator = torch.Generator().manual_seed(3)
    unit_rows = torch.nn.functional.normalize(torch.randn(VOCAB, RANK, generator=generator), dim=-1)
    with torch.no_grad():
        draft.fc.weight.zero_()
        draft.fc.weight[:, hidden:] = torch.eye(hidden)
        layer.self_attn.k_norm.weight.zero_()
        layer.self_attn.v_proj.weight.copy_(torch.eye(hidden))
        layer.self_attn.o_proj.weight.copy_(torch.eye(hidden))
        layer.post_attention_layernorm.weight.zero_()
        draft.norm.weight.copy_(target.model.norm.weight)
        draft.markov_head.markov_w1.weight.copy_(unit_rows)
        draft.markov_head.markov_w2.weight.copy_(unit_rows)
        draft.confidence_head.proj.bias.fill_(3.0)
    return module


@pytest.fixture(scope="module")
def trained_exports(tmp_path_factory) -> dict[str, tuple[DSparkModule, object]]:
    module = trained_module()
    root = tmp_path_factory.mktemp("dspark")
    return {layout: (module, module.export(root / layout, layout=layout)) for layout in LAYOUTS}


# --- served decoding ----------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
def test_trained_export_decodes_losslessly_with_served_and_tau_sim_side_by_side(
    layout, trained_exports, tmp_path
):
    module, export = trained_exports[layout]
    prompts = random_docs([5, 8, 11], vocab=MASK, seed=21)
    report = evaluate_export(
        export, prompts, target=module.target, max_new_tokens=12, stop_token_ids=(), check_lossless=True
    )

    assert report.lossless is True
    assert_target_greedy(module.target, prompts, report.generations, 12)
    assert report.architecture == {"specforge": "DSparkDraftModel", "nemo": "Qwen3DSparkModel"}[layout]
    assert report.num_steps == BLOCK and report.rounds >= 3 and report.generated_tokens == 3 * 12
    assert 1.0 <= report.served.accept_len <= MAX_ACCEPT
    assert report.training is not None and 1.0 <= report.training.accept_len <= MAX_ACCEPT
    assert len(report.served.prefix_rate) == len(report.training.prefix_rate) == BLOCK
    assert report.export.target_layer_ids == tuple(TRAINED_LAYERS)
    details = report.export.details
    assert details["mask_token_id"] == MASK and details["block_size"] == BLOCK and details["layout"] == layout
    assert details["markov_rank"] == RANK and details["sglang_capturable_layer_ids"] is False
    table = report.format_table()
    assert "served" in table and "tau_sim" in table and "accept_len" in table
    payload = json.loads(report.write_json(tmp_path / "report.json").read_text())
    assert payload["served"]["accept_len"] == report.served.accept_len
    assert payload["training"]["accept_len"] == report.training.accept_len


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_perfect_draft_reaches_the_maximum_acceptance_length(layout, tmp_path):
    """See :func:`perfect_module`: the draft carries the target's own final-norm features to every slot."""
    module = perfect_module()
    prompts = repeated_prompts()
    for prompt in prompts:
        assert greedy_generate(module.target, prompt, 6) == [int(prompt[-1])] * 6, "the target must repeat"
    export = module.export(tmp_path / "draft", layout=layout)
    report = evaluate_export(export, prompts, target=module.target, max_new_tokens=16, stop_token_ids=())

    assert report.served.accept_len == MAX_ACCEPT
    assert report.served.prefix_rate == [1.0] * BLOCK
    assert report.served.position_accuracy == [1.0] * BLOCK
    assert report.training.accept_len == pytest.approx(MAX_ACCEPT)
    assert report.generations == [[int(p[-1])] * 16 for p in prompts]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_wrong_mask_token_id_collapses_served_acceptance(layout, tmp_path):
    """Another in-vocabulary id is a valid config the validator cannot tell from the trained one; served
    decoding shows it. Slots 1..K-1 now carry a real token's embedding and fail; slot 0 holds the anchor,
    not the mask, so it still proposes right: acceptance falls from K + 1 to 2."""
    module = perfect_module()
    export = module.export(tmp_path / "draft", layout=layout)

    def wrong_mask(config: dict) -> None:
        (config["dflash_config"] if layout == "specforge" else config)["mask_token_id"] = 7

    broken = rewrite_export(export, tmp_path / "broken", config_edit=wrong_mask)
    validate_export(broken, module.target)
    prompts = repeated_prompts()
    good = evaluate_export(
        export, prompts, target=module.target, max_new_tokens=8, with_training_estimate=False
    )
    bad = evaluate_export(
        broken, prompts, target=module.target, max_new_tokens=8, with_training_estimate=False
    )
    assert good.served.accept_len == MAX_ACCEPT
    assert bad.served.accept_len == 2.0 and bad.served.prefix_rate[1] == 0.0
    assert bad.generations == good.generations  # still lossless: the target corrects every token


def test_num_steps_shorter_than_the_block_cuts_proposals_and_the_estimate(tmp_path):
    module = perfect_module()
    export = module.export(tmp_path / "draft")
    report = evaluate_export(
        export, repeated_prompts(), target=module.target, max_new_tokens=10, num_steps=2, stop_token_ids=()
    )
    assert report.served.accept_len == 3 and len(report.training.prefix_rate) == 2
    assert report.training.accept_len == pytest.approx(3)
    with pytest.raises(ValueError, match="num_steps = 5 must be in"):
        evaluate_export(export, repeated_prompts(), target=module.target, num_steps=BLOCK + 1)


# --- the validator ------------------------------------------------------------------------------------


def _section(config: dict) -> dict:
    """Where the export keeps mask_token_id / target_layer_ids: dflash_config (SpecForge) or the top level."""
    return config.get("dflash_config", config)


def _edit(**values) -> Callable[[dict], None]:
    return lambda config: _section(config).update(values)


def _top(**values) -> Callable[[dict], None]:
    return lambda config: config.update(values)


def _pop(name: str) -> Callable[[dict], None]:
    return lambda config: _section(config).pop(name)


def _shift_layer_ids(config: dict) -> None:
    _section(config)["target_layer_ids"] = [i + 1 for i in _section(config)["target_layer_ids"]]


def _nan(tensors: dict) -> None:
    tensors["norm.weight"][0] = float("nan")


# name -> (config edit, tensor edit, message); ``{ids}`` is "dflash_config." or "" by layout.
BROKEN_EXPORTS = {
    "layer ids shifted past the target": (
        _shift_layer_ids,
        None,
        r"{ids}target_layer_ids: is \[4, 8\]; it names features outside the target's 8 decoder layers",
    ),
    "layer ids out of order": (_edit(target_layer_ids=[7, 3]), None, r"must be strictly increasing"),
    "layer id below the embedding": (_edit(target_layer_ids=[-2, 3]), None, r"names features outside"),
    "layer ids dropped": (_pop("target_layer_ids"), None, r"{ids}target_layer_ids: is None"),
    "a layer id more than fc reads": (
        _edit(target_layer_ids=[1, 3, 7]),
        None,
        r"fc\.weight: has shape \(32, 64\) but config.json implies \(32, 96\)",
    ),
    "mask token outside the vocabulary": (
        _edit(mask_token_id=VOCAB),
        None,
        r"{ids}mask_token_id: is 96; .*\[0, 96\)",
    ),
    "mask token is eos": (
        _edit(mask_token_id=EOS),
        None,
        r"{ids}mask_token_id: is 1, the target's eos token",
    ),
    "mask token dropped": (_pop("mask_token_id"), None, r"{ids}mask_token_id: is None"),
    "block size dropped": (lambda c: c.pop("block_size"), None, r"block_size: is None"),
    "block size zero": (_top(block_size=0), None, r"block_size: is 0"),
    "negative markov rank": (_top(markov_rank=-1), None, r"markov_rank: is -1"),
    "unknown markov head": (_top(markov_head_type="lstm"), None, r"markov_head_type: is 'lstm'"),
    "confidence flag not a bool": (
        _top(enable_confidence_head="yes"),
        None,
        r"enable_confidence_head: is 'yes'",
    ),
    "confidence head reading a missing markov latent": (
        _top(markov_rank=0),
        None,
        r"confidence_head_with_markov: is true but markov_rank is 0",
    ),
    "another target's depth": (_top(num_target_layers=36), None, r"num_target_layers: is 36"),
    "another target's width": (_top(hidden_size=64), None, r"hidden_size: is 64 but the target has 32"),
    "rope_theta dropped": (lambda c: c.pop("rope_theta"), None, r"rope_theta: is None"),
    "sliding window": (_top(use_sliding_window=True), None, r"use_sliding_window: is true"),
    "dtype mislabelled": (_top(torch_dtype="bfloat16"), None, r"torch_dtype: is 'bfloat16'"),
    "dropped fc": (None, lambda t: t.pop("fc.weight"), r"fc\.weight: missing"),
    "dropped markov w2": (
        None,
        lambda t: t.pop("markov_head.markov_w2.weight"),
        r"markov_head\.markov_w2\.weight: missing",
    ),
    "dropped markov w1": (
        None,
        lambda t: t.pop("markov_head.markov_w1.weight"),
        r"markov_head\.markov_w1\.weight: missing",
    ),
    "zeroed fc": (None, lambda t: t["fc.weight"].zero_(), r"fc\.weight: is constant"),
    "zeroed markov w2": (
        None,
        lambda t: t["markov_head.markov_w2.weight"].zero_(),
        r"markov_head\.markov_w2\.weight: is constant",
    ),
    "confidence head at init": (
        None,
        lambda t: t["confidence_head.proj.bias"].zero_(),
        r"confidence_head\.proj\.bias: is still exactly 0",
    ),
    "NaN weight": (None, _nan, r"norm\.weight: holds NaN"),
}
SPECFORGE_BROKEN_EXPORTS = {
    "gated markov head": (
        lambda c: [c.update(markov_head_type="gated"), c["dflash_config"].update(markov_head_type="gated")],
        None,
        r"markov_head_type: is 'gated'; SpecForge's DSparkDraftModel implements only 'vanilla'",
    ),
    "head settings disagree": (
        lambda c: c["dflash_config"].update(markov_rank=16),
        None,
        r"dflash_config\.markov_rank: is 16 but the top-level markov_rank is 8",
    ),
    "causal": (_top(is_causal=True), None, r"is_causal: is True"),
    "projector type": (_edit(projector_type="dflash"), None, r"dflash_config\.projector_type: is 'dflash'"),
    "no dflash_config": (lambda c: c.pop("dflash_config"), None, r"dflash_config: is None"),
    "an LM head shipped": (
        None,
        lambda t: t.update({"lm_head.weight": torch.randn(VOCAB, 32)}),
        r"lm_head\.weight: is not a tensor of the DSparkDraftModel layout",
    ),
}
NEMO_BROKEN_EXPORTS = {
    "dropped LM head": (None, lambda t: t.pop("lm_head.weight"), r"lm_head\.weight: missing"),
    "random LM head": (
        None,
        lambda t: t["lm_head.weight"].normal_(std=0.02),
        r"lm_head\.weight: is not the target's",
    ),
    "another embedding": (
        None,
        lambda t: t["embed_tokens.weight"].copy_(t["embed_tokens.weight"].roll(1, 0)),
        r"embed_tokens\.weight: is not the target's",
    ),
    "zeroed LM head": (None, lambda t: t["lm_head.weight"].zero_(), r"lm_head\.weight: is constant"),
}
CASES = (
    [(layout, case) for layout in LAYOUTS for case in BROKEN_EXPORTS]
    + [("specforge", case) for case in SPECFORGE_BROKEN_EXPORTS]
    + [("nemo", case) for case in NEMO_BROKEN_EXPORTS]
)


@pytest.mark.parametrize(("layout", "case"), CASES, ids=[f"{layout}-{case}" for layout, case in CASES])
def test_the_validator_names_each_defect(layout, case, trained_exports, tmp_path):
    module, export = trained_exports[layout]
    config_edit, tensor_edit, message = {**BROKEN_EXPORTS, **SPECFORGE_BROKEN_EXPORTS, **NEMO_BROKEN_EXPORTS}[
        case
    ]
    broken = rewrite_export(export, tmp_path / "broken", config_edit, tensor_edit)
    prefix = r"dflash_config\." if layout == "specforge" else ""
    with pytest.raises(ValueError, match=message.replace("{ids}", prefix)):
        validate_export(broken, module.target)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_an_untrained_export_is_refused(layout, tmp_path):
    module = make(sharpened_target())
    export = module.export(tmp_path / "untrained", layout=layout)
    with pytest.raises(ValueError, match="RMSNorm gains are still exactly 1.0") as error:
        validate_export(export, module.target)
    assert "confidence_head.proj.bias: is still exactly 0" in str(error.value)


def test_evaluate_refuses_a_broken_export_before_decoding(trained_exports, tmp_path):
    module, export = trained_exports["specforge"]
    broken = rewrite_export(
        export, tmp_path / "broken", tensor_edit=lambda t: t.pop("markov_head.markov_w2.weight")
    )
    with pytest.raises(ValueError, match="markov_head.markov_w2.weight: missing"):
        evaluate_export(broken, random_docs([5], vocab=MASK, seed=3), target=module.target, max_new_tokens=4)


# --- the served block is the trained block -----------------------------------------------------------


CONSISTENCY = [
    ("specforge", {}),
    ("nemo", {"markov_head_type": "gated", "target_layer_ids": [-1, 3, LAST_LAYER]}),
    ("nemo", {"markov_head_type": "rnn", "confidence_head_with_markov": False}),
    ("specforge", {"markov_rank": 0, "confidence_head_alpha": 0.0, "target_layer_ids": [2, 5]}),
]


@pytest.mark.parametrize(
    ("layout", "options"),
    CONSISTENCY,
    ids=["specforge-vanilla", "nemo-gated-embedding-feature", "nemo-rnn", "specforge-no-heads"],
)
def test_the_served_block_equals_the_training_modules_block(layout, options, tmp_path):
    """From the exported files, fed the true prefix, the speculator's block equals the training module's
    for the same anchor: same features (-1 = embedding output, L-1 = final-norm output), mask token,
    context strictly before the anchor, RoPE positions and heads. Given training's teacher-forced previous
    tokens the logits match; the greedy walk's tokens are the fixed point of training's heads fed the
    walk's own previous tokens (slot k's previous token is the draft of slot k - 1)."""
    module = make(TINY_TARGETS["qwen3"], **options)
    perturb(module, scale=0.05)
    head = module.draft.markov_head
    if head is not None:  # a bigram bias strong enough to overrule the backbone somewhere
        with torch.no_grad():
            head.markov_w2.weight.mul_(100)
    export = module.export(tmp_path / "draft", layout=layout)
    validate_export(export, module.target)
    speculator = load_speculator(export, module.target, BLOCK)
    assert isinstance(speculator, Speculator) and isinstance(speculator, DSparkSpeculator)
    document = random_docs([14], vocab=MASK, seed=60)[0]
    packed = validate_batch({"input_ids": document[None]})
    overruled = 0
    for anchor in (0, 4, 9):
        layout_ = block_layout(packed, torch.tensor([[anchor]]), BLOCK)
        with torch.no_grad():
            features, _ = capture_context_features(module.target, packed, module.target_layer_ids)
            hidden = module._draft_hidden(packed, layout_, features)
            supervision = block_supervision(packed, layout_)
            trained, trained_confidence = module.draft.heads(hidden, supervision.previous)
        captured = module.target(
            validate_batch({"input_ids": document[None, : max(anchor, 1)]}), speculator.target_layer_ids
        )
        prefix = VerifiedPrefix(
            document[: anchor + 1],
            tuple(h[0, :anchor] for h in captured.hidden_states),
            captured.last_hidden_state[0, :anchor],
            module.target,
        )
        served_hidden = speculator.block_hidden(prefix)
        torch.testing.assert_close(served_hidden, hidden[0], rtol=1e-5, atol=1e-5)
        logits, confidence = speculator.block_logits(served_hidden, supervision.previous[0])
        torch.testing.assert_close(logits, trained[0], rtol=1e-5, atol=1e-5)
        if trained_confidence is None:
            assert confidence is None
        else:
            torch.testing.assert_close(confidence, trained_confidence[0], rtol=1e-5, atol=1e-5)

        block = speculator.draft_block(prefix)
        walked_previous = torch.cat([document[anchor : anchor + 1], block.tokens[:-1]])
        with torch.no_grad():
            walked, _ = module.draft.heads(hidden, walked_previous[None])
        assert block.tokens.tolist() == walked[0].argmax(-1).tolist()
        torch.testing.assert_close(block.logits, walked[0], rtol=1e-5, atol=1e-5)
        assert speculator.propose(prefix).tolist() == block.tokens.tolist()
        backbone = module.draft.lm_head(hidden[0]).argmax(-1)
        overruled += int((block.tokens != backbone).sum())
    if head is not None:
        assert overruled > 0, "the Markov head never overruled the backbone: the walk is not exercised"


def test_the_training_module_rebuilt_from_the_export_has_the_exported_weights(trained_exports):
    module, export = trained_exports["nemo"]
    rebuilt = load_training_module(export, module.target, BLOCK)
    assert type(rebuilt) is DSparkModule and rebuilt.dspark_config() == module.dspark_config()
    for name, tensor in module.draft.state_dict().items():
        assert torch.equal(rebuilt.draft.state_dict()[name], tensor), name


# --- CLI and callback ---------------------------------------------------------------------------------


def test_cli_evaluate_serves_a_dspark_export_with_an_explicit_target(trained_exports, tmp_path, capsys):
    _, export = trained_exports["specforge"]
    printed, report = cli_evaluate(export, tmp_path, capsys, "--target", qwen3_target_file(tmp_path))
    assert "accept_len" in printed and "tau_sim" in printed and "lossless: yes" in printed
    assert report["architecture"] == "DSparkDraftModel" and report["generated_tokens"] == 10


@pytest.mark.parametrize("family", ["dflash", "dflash2", "dspark"])
def test_cli_evaluate_rebuilds_the_target_the_export_records(family, tmp_path, capsys):
    target = TINY_TARGETS["qwen3"]
    if family == "dspark":
        module = trained_module(steps=1, target=target)
    else:
        module = dflash_trained_module(DFlash2Module if family == "dflash2" else DFlashModule, target=target)
    export = module.export(tmp_path / "draft")
    record = json.loads((export / "config.json").read_text())["lightning_drafts"]
    assert record["target"] == target and record["target_seed"] == 0

    printed, report = cli_evaluate(export, tmp_path, capsys)  # no --target: the recorded one
    assert "lossless: yes" in printed and report["generated_tokens"] == 10


@pytest.mark.parametrize(
    "options", [{}, {"markov_head_type": "gated"}], ids=["specforge-layout", "gated-head-nemo-layout"]
)
def test_the_callback_logs_served_acceptance_for_a_dspark_draft(options, tmp_path):
    # A draft SGLang's DSparkDraftModel cannot serve (gated head) is evaluated from NeMo's layout.
    module = make(TINY_TARGETS["qwen3"], **options)
    trainer = L.Trainer(
        max_steps=2,
        limit_val_batches=1,
        num_sanity_val_steps=0,
        accelerator="cpu",
        devices=1,
        logger=CSVLogger(tmp_path),
        callbacks=[ServedAcceptanceCallback(num_prompts=2, max_new_tokens=6)],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(
        module,
        DataLoader(PromptRows(4, vocab=MASK), batch_size=2),
        DataLoader(PromptRows(2, vocab=MASK), batch_size=2),
    )
    logged = trainer.logged_metrics
    assert "val/accept_len" in logged and "val/served_accept_len" in logged
    assert 1.0 <= float(logged["val/served_accept_len"]) <= MAX_ACCEPT
