"""The checks that build each draft themselves (in another process, or on a GPU) keep a list of the drafts
they run; every module class of the registry must be on each, so a new family cannot be left out of them
without a failure here that names the file. The lists are read from the files' syntax: the GPU script sets
torch's compile settings when imported."""

from __future__ import annotations

import ast
from pathlib import Path

from lightning_drafts.registry import REGISTRY
from tests.cli.test_cli import FAMILY_DEFAULTS
from tests.distributed.test_distributed import DRAFTS as DISTRIBUTED_TEST_DRAFTS

ROOT = Path(__file__).resolve().parents[1]
REGISTERED = {cls.__name__ for family in REGISTRY.families for cls in family.modules}


def assigned(path: Path, name: str) -> ast.expr:
    """The value assigned to the top-level ``name`` of ``path``."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name for t in node.targets):
            return node.value
    raise AssertionError(f"{path} assigns no {name}")


def called_classes(value: ast.expr) -> set[str]:
    """The capitalised names called or named anywhere in ``value`` (the module classes a list builds)."""
    names = set()
    for node in ast.walk(value):
        if isinstance(node, ast.Name) and node.id[:1].isupper():
            names.add(node.id)
    return names


def test_the_distributed_script_builds_every_registered_draft_and_its_test_checks_each():
    script = ROOT / "tests" / "scripts" / "distributed_grads.py"
    drafts = assigned(script, "DRAFTS")
    missing = REGISTERED - called_classes(drafts)
    assert not missing, f"add a builder of {sorted(missing)} to DRAFTS in {script}"
    names = {key.value for key in drafts.keys}
    assert set(DISTRIBUTED_TEST_DRAFTS) == names, (
        f"DRAFTS of tests/distributed/test_distributed.py {sorted(DISTRIBUTED_TEST_DRAFTS)} must name every "
        f"draft the script builds {sorted(names)}"
    )


def test_the_gpu_acceptance_run_builds_every_registered_draft():
    script = ROOT / "tools" / "gpu_paths.py"
    built = called_classes(assigned(script, "EAGLE3")) | called_classes(assigned(script, "BLOCK_DRAFTS"))
    missing = REGISTERED - built
    assert not missing, f"add {sorted(missing)} to EAGLE3 or BLOCK_DRAFTS in {script}"


def test_every_registered_draft_has_its_documented_defaults_checked():
    documented = {path.rsplit(".", 1)[-1] for path in FAMILY_DEFAULTS}
    missing = REGISTERED - documented
    assert not missing, (
        f"add {sorted(missing)}'s learning rate and warmup to FAMILY_DEFAULTS in tests/cli/test_cli.py"
    )
