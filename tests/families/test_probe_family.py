"""The seam a new family plugs in through: the probe family (tests/families/probe/, which the library
does not ship) is unknown to every workflow until it is registered, served and exported through the
registry while it is, and unknown again after. The conformance suite runs its whole contract on it."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from lightning_drafts.cli.main import main
from lightning_drafts.registry import REGISTRY
from lightning_drafts.serving.family import DraftFamily
from lightning_drafts.workflows.evaluate import evaluate_export
from lightning_drafts.workflows.export import export_checkpoint, validate_export
from tests.families.family_case import registered
from tests.families.probe import PROBE, ProbeDraft
from tests.families.probe.cases import build, trained
from tests.support.builders import TINY_TARGETS, random_docs, rewrite_export

pytestmark = pytest.mark.usefixtures("one_thread")
REGISTERED = pytest.mark.parametrize("family", [PROBE], indirect=True, ids=["probe"])


def probe_checkpoint(tmp_path) -> str:
    """A Lightning checkpoint of a probe (what ``lightning-drafts fit`` writes), without a training run."""
    import lightning as L

    module = build(TINY_TARGETS["llama"])
    trainer = L.Trainer(accelerator="cpu", max_steps=0, logger=False, enable_checkpointing=False)
    trainer.strategy.connect(module)
    trainer.save_checkpoint(tmp_path / "probe.ckpt")
    return str(tmp_path / "probe.ckpt")


def test_an_unregistered_family_is_refused_by_every_workflow_with_the_fix(tmp_path):
    assert PROBE not in REGISTRY.families
    module = trained("llama")
    export = module.export(tmp_path / "draft")  # the family writes and checks its own layout
    with pytest.raises(ValueError, match="ProbeDraft belongs to no registered draft family.*registry.py"):
        REGISTRY.for_module(module)
    unknown = "no draft family serves architecture 'LightningDraftsNextTokenProbe'"
    with pytest.raises(ValueError, match=unknown):
        validate_export(export, module.target)
    with pytest.raises(ValueError, match=unknown):
        evaluate_export(export, random_docs([5], seed=1), target=module.target, max_new_tokens=4)
    with pytest.raises(ValueError, match="ProbeDraft belongs to no registered draft family"):
        export_checkpoint(probe_checkpoint(tmp_path), tmp_path / "served")
    assert not (tmp_path / "served").exists()


@REGISTERED
def test_a_registered_family_is_served_and_exported_through_the_registry(family, tmp_path, capsys):
    assert REGISTRY.for_architecture("LightningDraftsNextTokenProbe") is family
    export = export_checkpoint(probe_checkpoint(tmp_path), tmp_path / "served")
    assert REGISTRY.for_export(export) is PROBE
    assert validate_export(export).target_layer_ids == (2,)

    # `lightning-drafts evaluate` rebuilds the target the export records and serves the probe's speculator.
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps(p.tolist()) for p in random_docs([4, 6], seed=50)))
    out = tmp_path / "report.json"
    main(
        ["evaluate", str(export), "--prompts", str(prompts), "--max-new-tokens", "5"]
        + ["--ignore-eos", "--check-lossless", "--json", str(out)]
    )
    assert "lossless: yes" in capsys.readouterr().out
    report = json.loads(out.read_text())
    assert report["architecture"] == "LightningDraftsNextTokenProbe" and report["num_steps"] == 1
    assert report["generated_tokens"] == 10 and report["training"]["accept_len"] >= 1.0


@REGISTERED
def test_the_registry_refuses_a_second_claim_on_a_family_s_architecture_or_module(family):
    clash = DraftFamily(
        name="copy",
        modules=(),
        architectures=family.architectures,
        validate=family.validate,
        load_speculator=family.load_speculator,
        load_training_module=family.load_training_module,
        default_num_steps=family.default_num_steps,
    )
    with pytest.raises(
        ValueError, match=r"family 'copy' claims \['LightningDraftsNextTokenProbe'\], already 'probe'"
    ):
        REGISTRY.register(clash)
    with pytest.raises(ValueError, match=r"claims \['ProbeDraft'\]"):
        REGISTRY.register(replace(clash, architectures=("Other",), modules=(ProbeDraft,)))
    assert REGISTRY.families.count(family) == 1


def test_registration_lasts_exactly_the_block_even_when_it_fails():
    shipped = REGISTRY.families
    with registered(PROBE):
        assert REGISTRY.families == (*shipped, PROBE)
    assert REGISTRY.families == shipped
    with pytest.raises(RuntimeError, match="inside"), registered(PROBE):
        raise RuntimeError("inside")
    assert REGISTRY.families == shipped
    with registered(shipped[0]):  # a shipped family is left where it is
        assert REGISTRY.families == shipped
    assert REGISTRY.families == shipped


@REGISTERED
def test_the_probe_validator_names_each_defect_through_validate_export(family, tmp_path):
    module = trained("qwen3")
    export = module.export(tmp_path / "draft")
    broken = {
        "head.weight: missing": (None, lambda t: t.pop("head.weight")),
        "head.weight: is constant": (None, lambda t: t["head.weight"].zero_()),
        "hidden_size: is 64 but the target has 32": (lambda c: c.update(hidden_size=64), None),
        r"target_layer_ids: \[9\] is outside the target's 8 layers": (
            lambda c: c.update(target_layer_ids=[9]),
            None,
        ),
        "head.bias: holds NaN": (None, lambda t: t["head.bias"].fill_(float("nan"))),
    }
    for index, (message, (config_edit, tensor_edit)) in enumerate(broken.items()):
        copy = rewrite_export(export, tmp_path / f"broken{index}", config_edit, tensor_edit)
        with pytest.raises(ValueError, match=message):
            validate_export(copy, module.target)
    with pytest.raises(ValueError, match="num_steps = 2: the probe proposes exactly one token"):
        evaluate_export(export, random_docs([5], seed=2), target=module.target, num_steps=2)
    assert torch.equal(family.load_training_module(export, module.target, 1).head.weight, module.head.weight)
