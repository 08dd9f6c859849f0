"""Serving-faithful evaluation of DFlash and DFlash2 exports: what is DFlash's own. The export validator
names each defect, an untrained export is refused, and the served block (one per round, DFlash2 through
its path selector) equals the training module's.

(Lossless served decoding and the reload of every family: tests/families/test_conformance.py; a perfect
draft, a wrong mask token and shorter rounds: tests/serving/test_served_evaluate.py; the CLI and the
callback: tests/cli/test_evaluate_cli.py, tests/serving/test_served_acceptance_callback.py.)"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from lightning_drafts import DFlash2Module, DFlashModule
from lightning_drafts.attention.block_masks import block_layout
from lightning_drafts.core.batch import validate_batch
from lightning_drafts.dflash.speculate import load_speculator
from lightning_drafts.serving.family import VerifiedPrefix
from lightning_drafts.workflows.export import validate_export
from tests.families.dflash.cases import (
    EOS,
    FAMILIES,
    FAMILY_IDS,
    MASK,
    make,
    sharpened_target,
    trained_module,
)
from tests.support.block_draft_cases import BLOCK
from tests.support.builders import TINY_TARGETS, VOCAB, random_docs, rewrite_export

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def trained_exports(tmp_path_factory) -> dict[str, tuple[DFlashModule, Path]]:
    exports = {}
    for (module_class, _), name in zip(FAMILIES, FAMILY_IDS, strict=True):
        module = trained_module(module_class)
        exports[name] = module, module.export(tmp_path_factory.mktemp(name) / "draft")
    return exports


# --- the validator ------------------------------------------------------------------------------------


def _shift_layer_ids(config: dict) -> None:
    config["dflash_config"]["target_layer_ids"] = [i + 1 for i in config["dflash_config"]["target_layer_ids"]]


def _one_more_layer(config: dict) -> None:
    ids = config["dflash_config"]["target_layer_ids"]
    # Still strictly increasing, so only fc's width is wrong.
    config["dflash_config"]["target_layer_ids"] = sorted(
        [*ids, min(ids) - 1 if min(ids) > 0 else max(ids) + 1]
    )


def _set(section: str | None, **values) -> Callable[[dict], None]:
    def edit(config: dict) -> None:
        (config[section] if section else config).update(values)

    return edit


def _drop(section: str | None, name: str) -> Callable[[dict], None]:
    return lambda config: (config[section] if section else config).pop(name)


def _identity_conv(tensors: dict) -> None:
    kernel = tensors["layers.0.mlp_conv.base_kernel"].zero_()
    kernel[:, 0] = 1


def _nan(tensors: dict) -> None:
    tensors["norm.weight"][0] = float("nan")


BROKEN_EXPORTS = {
    "layer ids shifted past the target": (
        _shift_layer_ids,
        None,
        r"dflash_config\.target_layer_ids: is \[4, 8\]; it names layers outside the target's 8 decoder layers",
    ),
    "layer ids dropped": (
        _drop("dflash_config", "target_layer_ids"),
        None,
        "dflash_config.target_layer_ids: is None",
    ),
    "a layer id more than fc reads": (
        _one_more_layer,
        None,
        r"fc\.weight: has shape \(32, 64\) but config.json implies \(32, 96\)",
    ),
    "mask token outside the vocabulary": (
        _set("dflash_config", mask_token_id=VOCAB),
        None,
        r"dflash_config\.mask_token_id: is 96; .*\[0, 96\)",
    ),
    "mask token is eos": (_set("dflash_config", mask_token_id=EOS), None, "the target's eos token"),
    "mask token dropped": (
        _drop("dflash_config", "mask_token_id"),
        None,
        "dflash_config.mask_token_id: is None",
    ),
    "block sizes disagree": (_set(None, block_size=BLOCK + 1), None, "block_size: is 5 at the top level"),
    "block size dropped": (_drop("dflash_config", "block_size"), None, "dflash_config.block_size: is None"),
    "causal": (_set(None, is_causal=True), None, "is_causal: is True"),
    "rope_theta dropped": (_drop(None, "rope_theta"), None, "rope_theta: is None"),
    "partial rotary leaked": (_set(None, partial_rotary_factor=0.25), None, "partial_rotary_factor: is set"),
    "head_dim dropped": (_drop(None, "head_dim"), None, "head_dim: missing"),
    "another target's depth": (_set(None, num_target_layers=36), None, "num_target_layers: is 36"),
    "another target's width": (_set(None, hidden_size=64), None, "hidden_size: is 64 but the target has 32"),
    "dtype mislabelled": (_set(None, torch_dtype="bfloat16"), None, "torch_dtype: is 'bfloat16'"),
    "dropped fc": (None, lambda t: t.pop("fc.weight"), "fc.weight: missing"),
    "zeroed fc": (None, lambda t: t["fc.weight"].zero_(), "fc.weight: is constant"),
    "an LM head shipped": (
        None,
        lambda t: t.update({"lm_head.weight": torch.ones(VOCAB, 32)}),
        "lm_head.weight: is not a tensor",
    ),
    "NaN weight": (None, _nan, "norm.weight: holds NaN"),
}
DFLASH2_BROKEN_EXPORTS = {
    "untrained selector": (
        None,
        lambda t: t["candidate_selector.successor_codebook"].zero_(),
        "candidate_selector.successor_codebook: is still all zeros",
    ),
    "untrained conv": (
        None,
        _identity_conv,
        "layers.0.mlp_conv.base_kernel: is still the identity",
    ),
    "selector top-k past the vocabulary": (
        _set("dflash_config", selector_top_k=VOCAB + 1),
        None,
        "dflash_config.selector_top_k: is 97",
    ),
    "conv group not dividing the width": (
        _set("dflash_config", conv_group_size=5),
        None,
        "dflash_config.conv_group_size: is 5; it must divide hidden_size 32",
    ),
    "conv sizes dropped": (
        _drop("dflash_config", "conv_kernel_size"),
        None,
        "dflash_config.conv_kernel_size: is None",
    ),
}
CASES = (
    [("dflash", case) for case in BROKEN_EXPORTS]
    + [("dflash2", case) for case in BROKEN_EXPORTS]
    + [("dflash2", case) for case in DFLASH2_BROKEN_EXPORTS]
)


@pytest.mark.parametrize(("name", "case"), CASES, ids=[f"{n}-{c}" for n, c in CASES])
def test_the_validator_names_each_defect(name, case, trained_exports, tmp_path):
    module, export = trained_exports[name]
    config_edit, tensor_edit, message = {**BROKEN_EXPORTS, **DFLASH2_BROKEN_EXPORTS}[case]
    broken = rewrite_export(export, tmp_path / "broken", config_edit, tensor_edit)
    with pytest.raises(ValueError, match=message):
        validate_export(broken, module.target)


@pytest.mark.parametrize(("module_class", "sizes"), FAMILIES, ids=FAMILY_IDS)
def test_an_untrained_export_is_refused(module_class, sizes, tmp_path):
    module = make(module_class, sharpened_target())
    export = module.export(tmp_path / "untrained")
    message = "successor_codebook: is still all zeros" if sizes else "RMSNorm gains are still exactly 1.0"
    with pytest.raises(ValueError, match=message):
        validate_export(export, module.target)


# --- the served block is the trained block -----------------------------------------------------------


CONSISTENCY = [
    (DFlashModule, {}),
    (DFlashModule, {"sliding_window": 3}),
    (DFlash2Module, {}),
]


@pytest.mark.parametrize(("module_class", "options"), CONSISTENCY, ids=["dflash", "dflash-window", "dflash2"])
def test_the_served_block_equals_the_training_modules_block(module_class, options, tmp_path):
    """From the exported files, fed the true prefix, the speculator's block logits equal the training
    module's for the same anchor: same captured layers, mask token, context (strictly before the anchor,
    windowed), RoPE positions and, for DFlash2, convs; DFlash2's proposal is training's greedy selector walk."""
    module = make(module_class, TINY_TARGETS["qwen3"], **options)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for parameter in module.draft.parameters():  # away from the init everywhere, norms included
            parameter.add_(0.05 * torch.randn(parameter.shape, generator=generator))
        if module_class is DFlash2Module:  # pair terms strong enough to overrule the logits somewhere
            module.draft.candidate_selector.successor_codebook.mul_(400)
    export = module.export(tmp_path / "draft")
    speculator = load_speculator(export, module.target, BLOCK - 1)
    document = random_docs([14], vocab=MASK, seed=60)[0]
    packed = validate_batch({"input_ids": document[None]})
    overruled = 0
    for anchor in (0, 4, 9):
        layout = block_layout(packed, torch.tensor([[anchor]]), BLOCK)
        with torch.no_grad():
            hidden = module._draft_hidden(packed, layout, torch.ones(1, dtype=torch.long))[:, 1:]
            trained = module._logits(hidden)[0]
        features = module.target(
            validate_batch({"input_ids": document[None, : max(anchor, 1)]}), speculator.target_layer_ids
        )
        prefix = VerifiedPrefix(
            document[: anchor + 1],
            tuple(h[0, :anchor] for h in features.hidden_states),
            features.last_hidden_state[0, :anchor],
            module.target,
        )
        block = speculator.draft_block(prefix)
        torch.testing.assert_close(block.logits, trained, rtol=1e-5, atol=1e-5)
        if module_class is DFlash2Module:
            selector = module.draft.candidate_selector
            unary, candidates = trained.topk(module.selector_top_k, dim=-1)
            walk = selector.greedy_walk(hidden, unary[None], candidates[None], document[anchor : anchor + 1])[
                0
            ]
            assert block.tokens.tolist() == walk.tolist()
            overruled += int((walk != trained.argmax(-1)).sum())
        else:
            assert block.tokens.tolist() == trained.argmax(-1).tolist()
    if module_class is DFlash2Module:
        assert overruled > 0, "the selector never overruled the logits: the walk is not exercised"
