"""The contract every draft family meets, checked the same way for each registered module class (and for
the probe family, which the library does not ship), on every tiny target kind it supports:

* packed == padded: the same documents packed into rows or one per padded row give the same loss, every
  gradient, the same chains and acceptance statistics, with the same anchors;
* document isolation: changing one document leaves every other document's outputs as they were;
* no leak: repeated loss + backward steps leave no tensor behind (host memory stays flat over a run);
* fail-loud: every batch the contract refuses raises ``ValueError`` naming the key, whatever the family;
  anchors are checked (or refused by a family that takes none); an unknown export layout is refused;
* export -> validate -> reload: the registry finds the family of the module and of the export, the
  validator passes, the reloaded module has the draft's weights and loss, the speculator loads;
* a Lightning checkpoint exports through the registry (``export_checkpoint``);
* served decoding of a trained export is lossless (``evaluate_export(check_lossless=True)``);
* the family's quickstart config trains, logs and exports through the CLI.

A family's specifics (its layouts' keys, its guards, its objective's parts) are tested in its own folder.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import lightning as L
import pytest
import torch
import yaml
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import Tensor

from lightning_drafts.cli.main import main, run_cli
from lightning_drafts.core.acceptance import prefix_counts
from lightning_drafts.core.batch import validate_batch
from lightning_drafts.core.draft_output import DraftOutput
from lightning_drafts.registry import REGISTRY
from lightning_drafts.serving.family import Speculator
from lightning_drafts.training.checkpoint_integrity import record_digests
from lightning_drafts.training.module import DraftModule
from lightning_drafts.workflows.evaluate import evaluate_export
from lightning_drafts.workflows.export import export_checkpoint, export_module, validate_export
from tests.cli.test_cli import short_fit
from tests.core.test_batch import BAD_BATCHES
from tests.families.cases import CASES, FAMILIES
from tests.families.family_case import ROOT, FamilyCase, Tolerance
from tests.families.probe import PROBE
from tests.support.block_draft_cases import ROWS, documents, twins, with_prompts
from tests.support.builders import (
    TINY_TARGETS,
    assert_no_tensor_outlives,
    assert_target_greedy,
    packed_row,
    padded_rows,
    random_docs,
    rewrite_export,
    stack_rows,
)

pytestmark = [
    # Tiny forwards (hundreds of them when decoding): a second thread only adds synchronisation.
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.filterwarnings("ignore:target_layer_ids .* standard SGLang captures"),
]

# Another document's tokens leave a document's outputs bit for bit as they were, except behind a MoE
# target: its expert matmuls see a different token batch when another document changes.
ISOLATION_ATOL = {"deepseek_v3": 1e-5}


def params(*axes: str) -> list:
    """``(family, case, ...)`` for every registered module class (and the probe's), crossed with the
    named axes: ``kind`` (each supported target kind), ``variant`` (construction options), ``layout``
    (the family's export layouts)."""
    rows = [((family, CASES[cls]), cls.__name__) for family in FAMILIES for cls in family.modules]
    for axis in axes:
        grown = []
        for values, label in rows:
            family, case = values[:2]
            if axis == "variant":
                # Every variant on the first target kind (the axis before), other kinds the first variant.
                first = next(iter(case.variants))
                options = [(first,)] if values[-1] != case.targets[0] else [(v,) for v in case.variants]
            else:
                options = [(o,) for o in {"kind": case.targets, "layout": family.layouts or (None,)}[axis]]
            grown += [((*values, *option), f"{label}-{option[0] or 'default'}") for option in options]
        rows = grown
    return [pytest.param(*values, id=label) for values, label in rows]


def run(
    module: DraftModule, batch: dict[str, Tensor], inputs: dict[str, Tensor]
) -> tuple[DraftOutput, dict[str, Tensor]]:
    """One loss and its backward; every trainable weight must get a gradient."""
    module.zero_grad(set_to_none=True)
    output = module.compute_loss(batch, **inputs)
    output.loss.backward()
    grads = {
        name: p.grad.clone()
        for name, p in module.named_parameters()
        if p.requires_grad and p.grad is not None
    }
    trainable = {name for name, p in module.named_parameters() if p.requires_grad}
    assert set(grads) == trainable, f"no gradient reached {sorted(trainable - set(grads))}"
    return output, grads


# --- the registry knows every family --------------------------------------------------------------------


def test_the_suite_runs_on_every_shipped_family():
    """An empty or shrunken registry must fail here, not leave the parametrised checks with nothing to run."""
    shipped = {cls.__name__ for family in REGISTRY.families for cls in family.modules}
    assert shipped >= {"Eagle3Module", "MLAEagle3Module", "DFlashModule", "DFlash2Module", "DSparkModule"}
    covered = {param.values[1].module_class.__name__ for param in params()}
    assert covered == shipped | {cls.__name__ for cls in PROBE.modules}


def test_every_registered_module_class_has_a_case_and_every_quickstart_a_registered_module():
    shipped = {cls for family in REGISTRY.families for cls in family.modules}
    assert shipped and shipped <= set(CASES), f"no conformance case for {shipped - set(CASES)}"
    configs = {path.resolve() for path in (ROOT / "configs" / "quickstart").glob("*.yaml")}
    assert configs == {CASES[cls].quickstart.resolve() for cls in shipped}, "a quickstart config is untested"
    for cls in set(CASES):
        config = yaml.safe_load(CASES[cls].quickstart.read_text())
        assert config["model"]["class_path"].rsplit(".", 1)[-1] == cls.__name__


# --- packed == padded -----------------------------------------------------------------------------------


def one_row() -> tuple[dict, dict]:
    """Four documents back to back in one row (trailing padding folded into the last), all supervised."""
    docs = documents([7, 5, 9, 4], seed=1)
    return packed_row(docs, 28), padded_rows(docs, 9)


def several_rows() -> tuple[dict, dict]:
    """Three rows with trailing padding, a document shorter than a block, each document's prompt
    unsupervised and a hole in the middle of each (chains are cut and restart)."""
    return twins(ROWS, width=20)


BATCHES: dict[str, Callable[[], tuple[dict, dict]]] = {"one-row": one_row, "rows": several_rows}


@pytest.mark.parametrize("layout", list(BATCHES))
@pytest.mark.parametrize(
    ("family", "case", "kind", "variant"), params("kind", "variant"), indirect=["family"]
)
def test_packed_equals_padded_loss_gradients_and_statistics(family, case: FamilyCase, kind, variant, layout):
    module = case.build(TINY_TARGETS[kind], **case.variants[variant])
    packed_batch, padded_batch = BATCHES[layout]()
    inputs = case.loss_inputs(module, packed_batch, 0)
    padded_inputs = case.padded_inputs(validate_batch(packed_batch), inputs)

    (a, grads_a), (b, grads_b) = run(module, packed_batch, inputs), run(module, padded_batch, padded_inputs)
    assert int(a.valid_tokens) == int(b.valid_tokens) > 0
    case.loss.assert_close(a.loss, b.loss, "loss")
    assert grads_a.keys() == grads_b.keys() and grads_a
    for name, grad in grads_b.items():
        assert grad.abs().sum() > 0, f"{name} got no gradient"
        case.grads.assert_close(grads_a[name], grad, name)
    assert torch.equal(a.valid, b.valid) and torch.equal(a.correct, b.correct)
    for count_a, count_b in zip(
        prefix_counts(a.correct, a.valid), prefix_counts(b.correct, b.valid), strict=True
    ):
        assert torch.equal(count_a, count_b)
    assert a.metrics.keys() == b.metrics.keys()
    for name in a.metrics:
        case.metrics.assert_close(a.metrics[name], b.metrics[name], name)
    assert a.sums.keys() == b.sums.keys()
    for name, (numerator, denominator) in a.sums.items():
        case.metrics.assert_close(numerator, b.sums[name][0], name)
        assert float(denominator) == pytest.approx(float(b.sums[name][1])), name


@pytest.mark.parametrize(("family", "case"), params(), indirect=["family"])
def test_training_steps_leave_no_tensor_behind(family, case: FamilyCase):
    """Repeated loss + backward steps keep the same live tensors: one kept per step (by a cache, a list,
    or a graph held alive through a reference cycle) grows host memory without bound over a run."""
    module = case.build(TINY_TARGETS[case.targets[0]])
    batch, _ = several_rows()
    inputs = case.loss_inputs(module, batch, 0)
    assert_no_tensor_outlives(lambda: run(module, batch, inputs))


@pytest.mark.parametrize(("family", "case", "kind"), params("kind"), indirect=["family"])
def test_one_document_with_packing_metadata_equals_the_bare_ids(family, case: FamilyCase, kind):
    module = case.build(TINY_TARGETS[kind])
    (doc,) = documents([20], seed=4)
    packed = packed_row([doc], 20)
    assert packed["seq_lens"].tolist() == [[20]]
    bare = {"input_ids": doc[None]}
    inputs = case.loss_inputs(module, packed, 0)
    with torch.no_grad():
        torch.testing.assert_close(
            module.compute_loss(packed, **inputs).loss,
            module.compute_loss(bare, **inputs).loss,
            rtol=0,
            atol=0,
        )
        if case.position_logits is not None:
            torch.testing.assert_close(
                case.position_logits(module, packed), case.position_logits(module, bare), rtol=0, atol=0
            )


# --- document isolation ---------------------------------------------------------------------------------

# Row 0: documents 0, 1, 2 at positions 0..8, 9..20, 21..31 (trailing padding folded in); row 1: document 3.
SPANS = {0: (0, slice(0, 9)), 1: (0, slice(9, 21)), 2: (0, slice(21, 32)), 3: (1, slice(0, 32))}


def isolation_batch(flipped: int | None = None) -> dict[str, Tensor]:
    docs = documents([9, 12, 8, 10], seed=5)
    if flipped is not None:
        docs[flipped] = torch.flip(docs[flipped], [0])
    return stack_rows([packed_row(docs[:3], 32), packed_row(docs[3:], 32)])


def only_document_one_supervised(batch: dict[str, Tensor]) -> dict[str, Tensor]:
    """Document 1 supervised after a 2-token prompt, nothing else: every chain lies in document 1."""
    batch = dict(batch)
    batch["loss_mask"] = torch.zeros_like(batch["loss_mask"])
    batch["loss_mask"][0, 11:21] = 1
    return batch


@pytest.mark.parametrize(("family", "case", "kind"), params("kind"), indirect=["family"])
def test_changing_one_document_leaves_every_other_documents_outputs_unchanged(family, case: FamilyCase, kind):
    module = case.build(TINY_TARGETS[kind])
    atol = ISOLATION_ATOL.get(kind, 0.0)
    same = Tolerance(rtol=0.0, atol=atol, scaled_atol=atol)
    reference_batch = only_document_one_supervised(isolation_batch())
    # The same anchors for every variant of the batch: only token ids change, never the masks.
    inputs = case.loss_inputs(module, reference_batch, 0)
    if case.takes_anchors:
        anchors = inputs["anchors"]
        assert (anchors >= 0).any() and ((anchors < 0) | ((anchors >= 11) & (anchors < 21))).all()
    reference, reference_grads = run(module, reference_batch, inputs)

    for other in (0, 2, 3):  # before it in its row, after it in its row, another row
        output, grads = run(module, only_document_one_supervised(isolation_batch(other)), inputs)
        same.assert_close(output.loss, reference.loss, f"loss with document {other} changed")
        assert torch.equal(output.correct, reference.correct) and torch.equal(output.valid, reference.valid)
        for name, value in reference.metrics.items():
            same.assert_close(output.metrics[name], value, name)
        for name, grad in reference_grads.items():
            same.assert_close(grads[name], grad, name)
    # The check can fail: document 1's own tokens matter.
    own = module.compute_loss(only_document_one_supervised(isolation_batch(1)), **inputs)
    assert not torch.allclose(own.loss, reference.loss)

    if case.position_logits is None:
        return
    # Position by position where the family has per-position logits, every document supervised.
    with torch.no_grad():
        logits = case.position_logits(module, with_prompts(isolation_batch()))
        changed = case.position_logits(module, with_prompts(isolation_batch(1)))
    for document, (row, span) in SPANS.items():
        if document == 1:
            assert not torch.allclose(changed[row, span], logits[row, span])
        else:
            same.assert_close(changed[row, span], logits[row, span], f"document {document}")


# --- fail-loud -----------------------------------------------------------------------------------------

UNKNOWN_LAYOUT = "layout 'no-such-layout' was given, but {name} (exports one layout only|writes the layouts)"


@pytest.mark.parametrize(("family", "case"), params(), indirect=["family"])
def test_every_bad_batch_raises_value_error_naming_the_key(family, case: FamilyCase):
    module = case.build(TINY_TARGETS[case.targets[0]])
    failures = []
    for name, (batch, match) in BAD_BATCHES.items():
        try:
            module.compute_loss(batch)
        except ValueError as error:
            if not re.search(match, str(error)):
                failures.append(f"{name}: {error}")
        else:
            failures.append(f"{name}: accepted")
    assert not failures, failures


@pytest.mark.parametrize(("family", "case"), params(), indirect=["family"])
def test_anchors_are_checked_and_an_unknown_layout_is_refused(family, case: FamilyCase, tmp_path):
    module = case.build(TINY_TARGETS[case.targets[0]])
    batch, _ = twins(ROWS, width=20)
    if case.takes_anchors:
        bad = [
            ("not a valid anchor", torch.tensor([[0], [-1], [-1]])),  # a prompt token
            ("not a valid anchor", torch.tensor([[8], [-1], [-1]])),  # a document's last token
            (r"\[B, N\]", torch.tensor([2, 3])),
            ("outside the row", torch.tensor([[20], [-1], [-1]])),
        ]
        for match, anchors in bad:
            with pytest.raises(ValueError, match=match):
                module.compute_loss(batch, anchors=anchors)
    else:
        with pytest.raises(ValueError, match="anchors"):
            module.compute_loss(batch, anchors=torch.zeros(1, 1, dtype=torch.long))
    with pytest.raises(ValueError, match=UNKNOWN_LAYOUT.format(name=case.name)):
        export_module(module, tmp_path / "draft", layout="no-such-layout")
    assert not (tmp_path / "draft").exists()


# --- export -> validate -> reload ----------------------------------------------------------------------


def check_reload(family, case: FamilyCase, module: DraftModule, export: Path, layout: str | None) -> None:
    """The registry finds ``export``'s family, it validates, and its reloaded module and speculator are
    the draft's."""
    assert REGISTRY.for_module(module) is family and REGISTRY.for_export(export) is family
    config = json.loads((export / "config.json").read_text())
    architecture = config["architectures"][0]
    assert architecture in family.architectures
    summary = validate_export(export, module.target)
    assert validate_export(export).architecture == summary.architecture == architecture
    assert summary.target_layer_ids == tuple(module.target_layer_ids)
    if layout is not None:
        assert summary.details["layout"] == layout
    steps = family.default_num_steps(config)
    assert steps == case.num_steps(module)

    reloaded = family.load_training_module(export, module.target, steps)
    assert type(reloaded) is type(module)
    expected, got = module.draft_state_dict(), reloaded.draft_state_dict()
    assert got.keys() == expected.keys()
    for name, value in expected.items():
        assert torch.equal(got[name], value), name
    assert tuple(reloaded.target_layer_ids) == tuple(module.target_layer_ids)
    if case.config_of is not None:
        assert case.config_of(reloaded) == case.config_of(module)
    batch, _ = twins(ROWS, width=20)
    inputs = case.loss_inputs(module, batch, 0)
    with torch.no_grad():
        torch.testing.assert_close(
            reloaded.compute_loss(batch, **inputs).loss,
            module.compute_loss(batch, **inputs).loss,
            rtol=0,
            atol=0,
        )
    speculator = family.load_speculator(export, module.target, steps)
    assert isinstance(speculator, Speculator) and speculator.num_steps == steps
    assert tuple(speculator.target_layer_ids) == summary.target_layer_ids


@pytest.mark.parametrize(("family", "case", "kind", "layout"), params("kind", "layout"), indirect=["family"])
def test_export_validates_and_reloads_into_the_same_draft(family, case: FamilyCase, kind, layout, tmp_path):
    module = case.build(TINY_TARGETS[kind])
    export = export_module(module, tmp_path / "draft", layout=layout)
    check_reload(family, case, module, export, layout)


@pytest.mark.parametrize(("family", "case", "layout"), params("layout"), indirect=["family"])
def test_a_draft_of_a_tied_target_trains_exports_and_validates(family, case: FamilyCase, layout, tmp_path):
    """A target whose LM head is its input embedding (tie_word_embeddings, as SmolLM2, Qwen3-0.6B, Gemma)
    trains a step, exports, validates and reloads into the same draft, like an untied one."""
    module = case.build({**TINY_TARGETS[case.targets[0]], "tie_word_embeddings": True})
    target = module.target
    assert target.lm_head.weight is target.input_embeddings.weight
    batch, _ = twins(ROWS, width=20)
    optimizer = torch.optim.SGD([p for p in module.parameters() if p.requires_grad], lr=1e-2)
    run(module, batch, case.loss_inputs(module, batch, 0))
    optimizer.step()
    # The frozen target stays tied and untouched by the step.
    assert target.lm_head.weight is target.input_embeddings.weight and not target.lm_head.weight.requires_grad
    export = export_module(module, tmp_path / "draft", layout=layout)
    check_reload(family, case, module, export, layout)


@pytest.mark.parametrize(("family", "case", "layout"), params("layout"), indirect=["family"])
def test_a_lightning_checkpoint_exports_through_the_registry(family, case: FamilyCase, layout, tmp_path):
    module = case.build(TINY_TARGETS[case.targets[0]])
    rows = [twins(ROWS, width=20, seed=seed)[0] for seed in range(2)]
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(module, torch.utils.data.DataLoader(rows, batch_size=None))
    trainer.save_checkpoint(tmp_path / "last.ckpt")
    saved = torch.load(tmp_path / "last.ckpt", weights_only=False)
    state = saved["state_dict"]
    assert state and not any(k.startswith(("target.", "ratio_metrics.")) for k in state)
    # A checkpoint from an FSDP2 run with every training-layout option exports on one process too.
    # (An edited checkpoint is refused as damaged, so its digests are recorded again, as that run's writer did.)
    saved["hyper_parameters"].update(shard_target=True, activation_checkpointing=True)
    record_digests(saved)
    torch.save(saved, tmp_path / "last.ckpt")

    export = export_checkpoint(tmp_path / "last.ckpt", tmp_path / "served", layout=layout)
    check_reload(family, case, module, export, layout)
    # `lightning-drafts export` is the same path, its --layout included.
    main(
        [
            "export",
            str(tmp_path / "last.ckpt"),
            str(tmp_path / "cli"),
            *(["--layout", layout] if layout else []),
        ]
    )
    check_reload(family, case, module, tmp_path / "cli", layout)
    with pytest.raises(ValueError, match=UNKNOWN_LAYOUT.format(name=case.name)):
        export_checkpoint(tmp_path / "last.ckpt", tmp_path / "other", layout="no-such-layout")
    assert not (tmp_path / "other").exists()


# --- served decoding ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("family", "case", "kind", "layout"), params("kind", "layout"), indirect=["family"])
def test_a_trained_export_decodes_losslessly_with_served_and_tau_sim_side_by_side(
    family, case: FamilyCase, kind, layout, tmp_path
):
    module = case.trained(kind)
    export = export_module(module, tmp_path / "draft", layout=layout)
    prompts = random_docs([5, 8, 11], vocab=case.vocab, seed=21)
    report = evaluate_export(
        export, prompts, target=module.target, max_new_tokens=12, stop_token_ids=(), check_lossless=True
    )

    steps = case.num_steps(module)
    assert report.lossless is True
    assert_target_greedy(module.target, prompts, report.generations, 12)
    assert report.architecture == json.loads((export / "config.json").read_text())["architectures"][0]
    assert report.num_steps == steps and report.rounds >= 3 and report.generated_tokens == 3 * 12
    assert report.training is not None
    assert len(report.served.prefix_rate) == len(report.training.prefix_rate) == steps
    # Served: the mean of (accepted + 1) over rounds equals 1 + sum_k P(accepted > k), the prefix rates
    # counted separately; tau_sim is 1 + sum_k hits[k] / chains[k], the same rates by its definition.
    for summary in (report.served, report.training):
        assert summary.accept_len == pytest.approx(1.0 + sum(summary.prefix_rate), rel=1e-6)
        assert all(0.0 <= r <= 1.0 for r in summary.prefix_rate)
    # A served round accepts a prefix: fewer rounds reach step k + 1 than step k.
    assert all(
        a >= b for a, b in zip(report.served.prefix_rate[:-1], report.served.prefix_rate[1:], strict=True)
    )
    assert report.export.target_layer_ids == tuple(module.target_layer_ids)
    assert {name: report.export.details.get(name) for name in case.details} == dict(case.details)
    if layout is not None:
        assert report.export.details["layout"] == layout
    table = report.format_table()
    assert "served" in table and "tau_sim" in table and "accept_len" in table
    payload = json.loads(report.write_json(tmp_path / "report.json").read_text())
    assert payload["served"]["accept_len"] == report.served.accept_len
    assert payload["training"]["accept_len"] == report.training.accept_len


@pytest.mark.parametrize(("family", "case", "layout"), params("layout"), indirect=["family"])
def test_evaluate_refuses_a_broken_export_before_decoding(family, case: FamilyCase, layout, tmp_path):
    module = case.trained(case.targets[0])
    export = export_module(module, tmp_path / "draft", layout=layout)
    broken = rewrite_export(export, tmp_path / "broken", tensor_edit=lambda t: t.pop(case.required_tensor))
    prompts = random_docs([5], vocab=case.vocab, seed=3)
    with pytest.raises(ValueError, match=re.escape(f"{case.required_tensor}: missing")):
        evaluate_export(broken, prompts, target=module.target, max_new_tokens=4)


# --- the quickstart config through the CLI --------------------------------------------------------------


@pytest.mark.parametrize(("family", "case"), params(), indirect=["family"])
def test_the_quickstart_config_fits_logs_and_exports(family, case: FamilyCase, tmp_path):
    cli = run_cli(short_fit(case.quickstart, tmp_path))
    assert type(cli.model) is case.module_class and cli.trainer.global_step == 4

    events = EventAccumulator(cli.trainer.logger.log_dir)
    events.Reload()
    scalars = set(events.Tags()["scalars"])
    assert {"train/loss", "train/accept_len", "train/valid_tokens", "val/loss", "val/accept_len"} <= scalars
    assert {"train/real_tokens_per_s", "train/padding_fraction"} <= scalars
    assert all(torch.isfinite(torch.tensor(e.value)) for e in events.Scalars("train/loss"))
    assert all(e.value >= 1.0 for e in events.Scalars("val/accept_len"))

    (best,) = Path(cli.trainer.logger.log_dir, "checkpoints").glob("best*.ckpt")
    state = torch.load(best, weights_only=False)["state_dict"]
    assert state and not any(key.startswith("target.") for key in state)

    main(["export", str(best), str(tmp_path / "export")])
    assert REGISTRY.for_export(tmp_path / "export") is family
    assert validate_export(tmp_path / "export").architecture in family.architectures
