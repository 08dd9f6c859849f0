"""Serving-faithful evaluation (issue 9) of DFlash and DFlash2: greedy speculative decoding from the exported
files (one block per round, DFlash2 through its path selector), the export validator, and the served block
against the training module's."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from lightning_drafts import DFlash2Module, DFlashModule
from lightning_drafts.attention.block_masks import block_layout
from lightning_drafts.callbacks import ServedAcceptanceCallback
from lightning_drafts.cli.main import main
from lightning_drafts.core.batch import validate_batch
from lightning_drafts.dflash.speculate import load_speculator, load_training_module
from lightning_drafts.serving.decode import greedy_generate
from lightning_drafts.serving.family import VerifiedPrefix
from lightning_drafts.workflows.evaluate import evaluate_export
from lightning_drafts.workflows.export import validate_export
from tests.builders import (
    TINY_TARGETS,
    VOCAB,
    PromptRows,
    assert_target_greedy,
    packed_row,
    random_docs,
    rewrite_export,
    stack_rows,
)

BLOCK = 4
MASK = VOCAB - 1  # reserved: never in a prompt or a training document
EOS = 1
DFLASH2_SIZES = {"conv_group_size": 4, "selector_rank": 8, "selector_top_k": 4}
FAMILIES = [(DFlashModule, {}), (DFlash2Module, DFLASH2_SIZES)]
FAMILY_IDS = ["dflash", "dflash2"]
LAST_LAYER = TINY_TARGETS["qwen3"]["num_hidden_layers"] - 1
# The last id is the target's last layer, so shifting the ids by one leaves the target.
TRAINED_LAYERS = [3, LAST_LAYER]


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Decoding runs hundreds of tiny forwards; a second thread only adds synchronisation to each."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# --- builders -----------------------------------------------------------------------------------------


def tiny_qwen3(**overrides) -> PreTrainedModel:
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(**{**TINY_TARGETS["qwen3"], **overrides}))


def sharpened_target() -> PreTrainedModel:
    """A tiny random Qwen3 whose LM head is scaled up, so its greedy choices are far from ties."""
    model = tiny_qwen3(eos_token_id=EOS)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(10)
    return model


def make(module_class: type[DFlashModule], target, **kwargs) -> DFlashModule:
    torch.manual_seed(0)
    sizes = DFLASH2_SIZES if module_class is DFlash2Module else {}
    return module_class(
        target,
        mask_token_id=MASK,
        num_draft_layers=kwargs.pop("num_draft_layers", 2),
        block_size=BLOCK,
        num_anchors=4,
        draft_attn_backend="sdpa",
        target_attn_backend="sdpa",
        **{**sizes, **kwargs},
    )


def training_batch() -> dict[str, torch.Tensor]:
    docs = random_docs([9, 7], vocab=MASK, seed=7) + random_docs([12], vocab=MASK, seed=8)
    return stack_rows([packed_row(docs[:2], 16), packed_row(docs[2:], 16)])


def trained_module(module_class: type[DFlashModule], steps: int = 4, target=None) -> DFlashModule:
    """A draft trained a few optimizer steps on a fixed batch (export, not quality, is under test)."""
    target = sharpened_target() if target is None else target
    module = make(module_class, target, target_layer_ids=TRAINED_LAYERS)
    batch = training_batch()
    optimizer = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(steps):
        optimizer.zero_grad()
        module.compute_loss(batch).loss.backward()
        optimizer.step()
    return module


def repeating_target() -> PreTrainedModel:
    """A tiny Qwen3 (every layer random) whose greedy output repeats its last token, with a null mask row.

    Its embeddings are scaled up until they dominate the residual stream, and its LM head is the
    row-normalised embedding, so the final hidden state at a token is closest to that token's own row.
    The reserved mask token's embedding (and LM-head) row is zero, as an unused row may be.
    """
    model = tiny_qwen3()
    with torch.no_grad():
        embedding = model.get_input_embeddings().weight.mul_(50)
        embedding[MASK] = 0
        norms = embedding.norm(dim=-1, keepdim=True).clamp(min=1e-6)
        model.get_output_embeddings().weight.copy_(10 * embedding / norms)
    return model


def perfect_module(module_class: type[DFlashModule]) -> DFlashModule:
    """A one-layer DFlash / DFlash2 draft that predicts, at every masked slot, what the target predicts.

    Construction (target: :func:`repeating_target`; prompts: one token repeated, so every context position
    carries the same target features ``f(a)`` and the target's greedy continuation is ``a a a ...``):

    * ``fc`` selects the chunk of ``target_layer_ids[1]``, the target's **last** layer, whose output the
      target's final norm and LM head turn into its greedy token ``a``; ``v_proj`` / ``o_proj`` are the
      identity (4 KV heads, so values are not squeezed through GQA);
    * ``k_norm`` is zero, so every key is 0 and attention is uniform: each slot averages the context values
      (all ``hidden_norm(f(a))``), the anchor slot's value (its embedding, along ``a``'s row) and the mask
      slots' values, which are zero because the mask token's embedding row is zero;
    * ``post_attention_layernorm`` is zero, so the MLP adds nothing; ``norm`` is the target's final norm.

    So every masked slot's logits are the target's own logits of ``a``: a draft served with the right
    mask token proposes ``a`` at every slot and reaches ``block_size``. DFlash2's convs and selector are
    moved off their (identity / zero) init but kept small, so they carry the same picks.
    """
    target = repeating_target()
    module = make(
        module_class,
        target,
        num_draft_layers=1,
        target_layer_ids=[3, LAST_LAYER],
        draft_overrides={"num_key_value_heads": 4},
    )
    draft, hidden = module.draft, module.draft.fc.weight.shape[0]
    layer = draft.layers[0]
    with torch.no_grad():
        draft.fc.weight.zero_()
        draft.fc.weight[:, hidden:] = torch.eye(hidden)
        layer.self_attn.k_norm.weight.zero_()
        layer.self_attn.v_proj.weight.copy_(torch.eye(hidden))
        layer.self_attn.o_proj.weight.copy_(torch.eye(hidden))
        layer.post_attention_layernorm.weight.zero_()
        draft.norm.weight.copy_(target.model.norm.weight)
        if module_class is DFlash2Module:
            for conv in (layer.attention_conv, layer.mlp_conv):
                conv.base_kernel[:, 1:] = 0.1
                conv.kernel_projection.weight.normal_(std=1e-3)
            draft.candidate_selector.successor_codebook.normal_(std=1e-2)
    return module


def repeated_prompts() -> list[torch.Tensor]:
    return [torch.full((length,), token) for length, token in ((5, 3), (7, 11), (9, 40))]


@pytest.fixture(scope="module")
def trained_exports(tmp_path_factory) -> dict[str, tuple[DFlashModule, Path]]:
    exports = {}
    for (module_class, _), name in zip(FAMILIES, FAMILY_IDS, strict=True):
        module = trained_module(module_class)
        exports[name] = module, module.export(tmp_path_factory.mktemp(name) / "draft")
    return exports


# --- served decoding ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", FAMILY_IDS)
def test_trained_export_decodes_losslessly_with_served_and_tau_sim_side_by_side(
    name, trained_exports, tmp_path
):
    module, export = trained_exports[name]
    prompts = random_docs([5, 8, 11], vocab=MASK, seed=21)
    report = evaluate_export(
        export, prompts, target=module.target, max_new_tokens=12, stop_token_ids=(), check_lossless=True
    )

    assert report.lossless is True
    assert_target_greedy(module.target, prompts, report.generations, 12)
    assert report.architecture == module.architecture
    assert report.num_steps == BLOCK - 1 and report.rounds >= 3 and report.generated_tokens == 3 * 12
    assert 1.0 <= report.served.accept_len <= BLOCK
    assert report.training is not None and 1.0 <= report.training.accept_len <= BLOCK
    assert len(report.served.prefix_rate) == len(report.training.prefix_rate) == BLOCK - 1
    assert report.export.target_layer_ids == tuple(module.target_layer_ids)
    assert report.export.details["mask_token_id"] == MASK and report.export.details["block_size"] == BLOCK
    table = report.format_table()
    assert "served" in table and "tau_sim" in table and "accept_len" in table
    payload = json.loads(report.write_json(tmp_path / "report.json").read_text())
    assert payload["served"]["accept_len"] == report.served.accept_len
    assert payload["training"]["accept_len"] == report.training.accept_len


@pytest.mark.parametrize(("module_class", "sizes"), FAMILIES, ids=FAMILY_IDS)
def test_a_perfect_draft_reaches_the_maximum_acceptance_length(module_class, sizes, tmp_path):
    """See :func:`perfect_module`: the draft carries the target's own last-layer computation to every slot."""
    module = perfect_module(module_class)
    prompts = repeated_prompts()
    for prompt in prompts:
        assert greedy_generate(module.target, prompt, 6) == [int(prompt[-1])] * 6, "the target must repeat"
    export = module.export(tmp_path / "draft")
    report = evaluate_export(export, prompts, target=module.target, max_new_tokens=16, stop_token_ids=())

    assert report.served.accept_len == BLOCK
    assert report.served.prefix_rate == [1.0] * (BLOCK - 1)
    assert report.served.position_accuracy == [1.0] * (BLOCK - 1)
    assert report.training.accept_len == pytest.approx(BLOCK)
    assert report.generations == [[int(p[-1])] * 16 for p in prompts]


@pytest.mark.parametrize(("module_class", "sizes"), FAMILIES, ids=FAMILY_IDS)
def test_a_wrong_mask_token_id_collapses_served_acceptance(module_class, sizes, tmp_path):
    """Another in-vocabulary id is a valid config the validator cannot tell from the trained one; served
    decoding shows it: the masked slots now carry a real token's embedding and every proposal fails."""
    module = perfect_module(module_class)
    export = module.export(tmp_path / "draft")
    broken = rewrite_export(
        export, tmp_path / "broken", config_edit=lambda c: c["dflash_config"].update(mask_token_id=7)
    )
    validate_export(broken, module.target)
    prompts = repeated_prompts()
    good = evaluate_export(
        export, prompts, target=module.target, max_new_tokens=8, with_training_estimate=False
    )
    bad = evaluate_export(
        broken, prompts, target=module.target, max_new_tokens=8, with_training_estimate=False
    )
    assert good.served.accept_len == BLOCK
    assert bad.served.accept_len == 1.0
    assert bad.generations == good.generations  # still lossless: the target corrects every token


def test_num_steps_shorter_than_the_block_cuts_proposals_and_the_estimate(tmp_path):
    module = perfect_module(DFlashModule)
    export = module.export(tmp_path / "draft")
    report = evaluate_export(
        export, repeated_prompts(), target=module.target, max_new_tokens=10, num_steps=2, stop_token_ids=()
    )
    assert report.served.accept_len == 3 and len(report.training.prefix_rate) == 2
    assert report.training.accept_len == pytest.approx(3)
    with pytest.raises(ValueError, match="num_steps = 4 must be in"):
        evaluate_export(export, repeated_prompts(), target=module.target, num_steps=BLOCK)


# --- the validator ------------------------------------------------------------------------------------


def _shift_layer_ids(config: dict) -> None:
    config["dflash_config"]["target_layer_ids"] = [i + 1 for i in config["dflash_config"]["target_layer_ids"]]


def _one_more_layer(config: dict) -> None:
    config["dflash_config"]["target_layer_ids"] = [*config["dflash_config"]["target_layer_ids"], 0]


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


def test_evaluate_refuses_a_broken_export_before_decoding(trained_exports, tmp_path):
    module, export = trained_exports["dflash"]
    broken = rewrite_export(export, tmp_path / "broken", tensor_edit=lambda t: t.pop("fc.weight"))
    with pytest.raises(ValueError, match="fc.weight: missing"):
        evaluate_export(broken, random_docs([5], vocab=MASK, seed=3), target=module.target, max_new_tokens=4)


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


def test_the_training_module_rebuilt_from_the_export_has_the_exported_weights(trained_exports):
    module, export = trained_exports["dflash2"]
    rebuilt = load_training_module(export, module.target, BLOCK - 1)
    assert type(rebuilt) is DFlash2Module and rebuilt.dflash_config() == module.dflash_config()
    for name, tensor in module.draft.state_dict().items():
        assert torch.equal(rebuilt.draft.state_dict()[name], tensor), name


# --- CLI ----------------------------------------------------------------------------------------------


def cli_evaluate(export, tmp_path, capsys, *extra: str) -> tuple[str, dict]:
    """``lightning-drafts evaluate`` on two prompts, 5 new tokens each: what it printed and its JSON report."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps(p.tolist()) for p in random_docs([4, 6], vocab=MASK, seed=50)))
    out = tmp_path / "report.json"
    main(
        ["evaluate", str(export), "--prompts", str(prompts), "--max-new-tokens", "5"]
        + ["--ignore-eos", "--check-lossless", "--json", str(out), *extra]
    )
    return capsys.readouterr().out, json.loads(out.read_text())


def qwen3_target_file(tmp_path) -> str:
    path = tmp_path / "target.json"
    path.write_text(json.dumps(TINY_TARGETS["qwen3"]))
    return str(path)


def test_cli_evaluate_serves_a_dflash_export_with_an_explicit_target(trained_exports, tmp_path, capsys):
    _, export = trained_exports["dflash"]
    printed, report = cli_evaluate(export, tmp_path, capsys, "--target", qwen3_target_file(tmp_path))
    assert "accept_len" in printed and "tau_sim" in printed and "lossless: yes" in printed
    assert report["architecture"] == "DFlashDraftModel" and report["generated_tokens"] == 10


# --- callback -----------------------------------------------------------------------------------------


def test_the_callback_logs_served_acceptance_for_a_dflash2_draft(tmp_path):
    module = make(DFlash2Module, TINY_TARGETS["qwen3"])
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
    assert 1.0 <= float(logged["val/served_accept_len"]) <= BLOCK
