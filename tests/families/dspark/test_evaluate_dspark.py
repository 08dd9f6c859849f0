"""Serving-faithful evaluation of DSpark exports in both layouts: what is DSpark's own. The export
validator names each defect, an untrained export is refused, and the served block (K proposals per round,
the Markov head walked greedily) equals the training module's.

(Lossless served decoding and the reload of every family: tests/families/test_conformance.py; a perfect
draft, a wrong mask token and shorter rounds: tests/serving/test_served_evaluate.py; the CLI and the
callback: tests/cli/test_evaluate_cli.py, tests/serving/test_served_acceptance_callback.py.)"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from lightning_drafts import DSparkModule
from lightning_drafts.attention.block_masks import block_layout
from lightning_drafts.core.batch import validate_batch
from lightning_drafts.dspark.context_features import context_features, hooked_layer_ids
from lightning_drafts.dspark.eval_mask import block_supervision
from lightning_drafts.dspark.speculate import DSparkSpeculator, load_speculator
from lightning_drafts.serving.family import Speculator, VerifiedPrefix
from lightning_drafts.workflows.export import validate_export
from tests.families.dflash.cases import EOS, LAST_LAYER, MASK, sharpened_target
from tests.families.dspark.cases import LAYOUTS, make, trained_module
from tests.support.block_draft_cases import BLOCK, perturb
from tests.support.builders import TINY_TARGETS, VOCAB, random_docs, rewrite_export

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.filterwarnings("ignore:target_layer_ids .* standard SGLang captures"),
]


@pytest.fixture(scope="module")
def trained_exports(tmp_path_factory) -> dict[str, tuple[DSparkModule, Path]]:
    module = trained_module()
    root = tmp_path_factory.mktemp("dspark")
    return {layout: (module, module.export(root / layout, layout=layout)) for layout in LAYOUTS}


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
    # What the SpecForge layout used to write: AutoModel with trust_remote_code would look for dspark.py.
    "auto_map without its code": (
        _top(auto_map={"AutoModel": "dspark.DSparkDraftModel"}),
        None,
        r"auto_map names code files the export does not contain \(\['dspark\.py'\]\)",
    ),
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
    # A gated head is served (SpecForge's and SGLang's loaders build it), so its weights must be there.
    "gated markov head without its gate": (
        lambda c: [c.update(markov_head_type="gated"), c["dflash_config"].update(markov_head_type="gated")],
        None,
        r"markov_head\.gate_proj\.weight: missing",
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


# --- the served block is the trained block -----------------------------------------------------------


CONSISTENCY = [
    ("specforge", {}),
    ("nemo", {"markov_head_type": "gated", "target_layer_ids": [-1, 3, LAST_LAYER]}),
    ("specforge", {"markov_head_type": "gated"}),
    ("specforge", {"markov_head_type": "rnn", "confidence_head_with_markov": False}),
    ("specforge", {"markov_rank": 0, "confidence_head_alpha": 0.0, "target_layer_ids": [2, 5]}),
]


@pytest.mark.parametrize(
    ("layout", "options"),
    CONSISTENCY,
    ids=[
        "specforge-vanilla",
        "nemo-gated-embedding-feature",
        "specforge-gated",
        "specforge-rnn",
        "specforge-no-heads",
    ],
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
            hooked = hooked_layer_ids(module.target_layer_ids, module.target.num_layers)
            output = module.target_output(packed, hooked)
            features = context_features(output, module.target, packed, module.target_layer_ids)
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
