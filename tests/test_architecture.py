"""The package's architecture, checked: the layer contracts (import-linter) hold on the package as it
installs and catch a lower layer importing a higher one, and no first-party import cycle exists, counting
imports inside functions."""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_drafts.serving.export_files import CONFIG_FILE, WEIGHTS_FILE
from lightning_drafts.workflows.export import export_checkpoint, load_draft_checkpoint
from tests.support.hang_guard import HANG_GUARD_S

ROOT = Path(__file__).resolve().parents[1]
# Source folder -> the module name it installs as (pyproject's package-dir).
SOURCES = {"lightning_drafts": "lightning_drafts", "datamodules": "lightning_drafts.datamodules"}
SOURCES["callbacks"] = "lightning_drafts.callbacks"


def lint_imports(site: Path, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(site)}
    lint = Path(sys.executable).with_name("lint-imports")
    return subprocess.run(
        [str(lint), "--no-cache", str(ROOT / "pyproject.toml")],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
    )


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """The project installed without dependencies into a scratch directory (what a wheel holds), with the
    layer contracts checked there by CI's own script."""
    site = tmp_path_factory.mktemp("install") / "site"
    # CI's script with this test's interpreter, not whichever python is first on PATH (a venv run as
    # VENV/bin/python -m pytest is not activated).
    lint = subprocess.run(
        ["bash", str(ROOT / ".ci" / "lint-imports"), str(site)],
        env={**os.environ, "PYTHON": sys.executable},
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
    )
    assert lint.returncode == 0 and "0 broken" in lint.stdout, lint.stdout + lint.stderr
    return site


def test_the_install_holds_one_namespace(installed):
    assert (installed / "lightning_drafts" / "datamodules" / "datamodule.py").is_file()
    assert (installed / "lightning_drafts" / "callbacks" / "acceptance.py").is_file()
    # The repository's folder names are not installed as top-level packages of their own.
    assert not (installed / "datamodules").exists() and not (installed / "callbacks").exists()


def test_the_layer_contracts_catch_an_upward_import(installed, tmp_path):
    broken_site = tmp_path / "site"
    shutil.copytree(installed, broken_site)
    # An import inside a function still counts: the core layer reaching up to the registry.
    batch = broken_site / "lightning_drafts" / "core" / "batch.py"
    batch.write_text(
        batch.read_text() + "\n\ndef _late():\n    from lightning_drafts.registry import REGISTRY\n"
    )
    broken = lint_imports(broken_site, tmp_path)
    assert broken.returncode != 0, broken.stdout
    assert "lightning_drafts.core.batch -> lightning_drafts.registry" in broken.stdout


def _module_name(path: Path) -> str:
    folder = path.relative_to(ROOT).parts[0]
    parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join([SOURCES[folder], *parts])


def _imports(tree: ast.AST, modules: set[str]) -> set[str]:
    """First-party modules a file imports, anywhere in it, those under ``if TYPE_CHECKING:`` included: an
    import for annotations only never runs, but a circle through it still ties the two files together."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                submodule = f"{node.module}.{alias.name}"
                found.add(submodule if submodule in modules else node.module)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found & modules


def import_graph() -> dict[str, set[str]]:
    files = [p for folder in SOURCES for p in (ROOT / folder).rglob("*.py")]
    modules = {_module_name(p) for p in files}
    return {_module_name(p): _imports(ast.parse(p.read_text()), modules) for p in files}


def test_no_first_party_import_cycle():
    graph = import_graph()
    assert len(graph) > 80 and "lightning_drafts.registry" in graph["lightning_drafts.workflows.export"]
    # Depth-first search for a back edge; any cycle is reported as its module chain.
    state: dict[str, int] = {}
    stack: list[str] = []

    def walk(module: str) -> None:
        state[module] = 1
        stack.append(module)
        for imported in sorted(graph[module]):
            if state.get(imported) == 1:
                cycle = stack[stack.index(imported) :] + [imported]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if imported not in state:
                walk(imported)
        stack.pop()
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            walk(module)


def test_only_the_facade_imports_the_facade():
    # `lightning_drafts/__init__.py` imports every layer; a module importing it would close a cycle.
    graph = import_graph()
    importers = sorted(m for m, imported in graph.items() if "lightning_drafts" in imported)
    assert importers == [], importers


def test_every_source_package_is_in_the_wheel():
    # pyproject lists the packages one by one (two come from the repository's own folders): a new family's
    # folder missing there still imports from a checkout, and is absent from the wheel users install.
    # The [tool.setuptools] packages list, read without tomllib (Python 3.11+; the project supports 3.10).
    block = re.search(
        r"^packages = \[(.*?)\]", (ROOT / "pyproject.toml").read_text(), re.MULTILINE | re.DOTALL
    )
    listed = set(re.findall(r'"([^"]+)"', block.group(1)))
    found = {
        ".".join([SOURCES[folder], *path.parent.relative_to(ROOT / folder).parts])
        for folder in SOURCES
        for path in (ROOT / folder).rglob("__init__.py")
    }
    assert found == listed, (sorted(found - listed), sorted(listed - found))


def test_the_tests_folder_holds_tests_at_its_root_and_what_they_share_in_support():
    # A helper at the root reads as a test module and hides among them; shared code lives in tests/support.
    helpers = sorted(
        p.name
        for p in (ROOT / "tests").glob("*.py")
        if not p.name.startswith("test_") and p.name not in {"__init__.py", "conftest.py"}
    )
    assert helpers == [], f"move these into tests/support/: {helpers}"
    assert not list((ROOT / "tests" / "support").glob("test_*.py"))


# Checkpoints and exports written by commit d429c0e, the flat layout before the layered package
# (made by make_fixtures.py in that folder, with that commit's code).
OLD_LAYOUT = ROOT / "tests" / "fixtures" / "layout_d429c0e"
OLD_EXPORTS = [
    ("eagle3", None),
    ("mla_eagle3", None),
    ("dflash", None),
    ("dflash2", None),
    ("dspark", "specforge"),
    ("dspark", "nemo"),
]


@pytest.mark.parametrize(("draft", "layout"), OLD_EXPORTS, ids=lambda v: str(v))
def test_a_checkpoint_of_the_old_layout_loads_and_exports_byte_identical(draft, layout, tmp_path):
    checkpoint = OLD_LAYOUT / f"{draft}.ckpt"
    module = load_draft_checkpoint(checkpoint)
    recorded = torch.load(checkpoint, weights_only=False)["draft_class"]
    # A class that has moved since (DFlash2Module, out of dflash/module.py) loads from where it was.
    expected = MOVED_SINCE_D429C0E.get(recorded, recorded)
    assert f"{type(module).__module__}.{type(module).__qualname__}" == expected
    exported = export_checkpoint(checkpoint, tmp_path / "export", layout=layout)
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        old = (OLD_LAYOUT / f"{draft}-{layout}" / name).read_bytes()
        if name == CONFIG_FILE and draft in LAYOUT_CHANGES_SINCE_D429C0E:
            changed = {**json.loads(old), **LAYOUT_CHANGES_SINCE_D429C0E[draft]}
            old = _json_bytes({k: v for k, v in changed.items() if v is not REMOVED})
        assert (exported / name).read_bytes() == old, name


# Module classes defined elsewhere since d429c0e, written out here (not read from the classes).
MOVED_SINCE_D429C0E = {
    "lightning_drafts.dflash.module.DFlash2Module": "lightning_drafts.dflash.dflash2_module.DFlash2Module"
}

# Deliberate changes to an export layout since d429c0e, applied to that commit's config.json (the fields keep
# their places; the weights stay byte-identical): the MLA draft now writes the layout vLLM's DeepSeek MLA
# EAGLE-3 class loads instead of the project's own name (its rope_scaling, null in the fixture, is unchanged);
# the DSpark SpecForge layout no longer writes an auto_map naming a dspark.py it never shipped.
REMOVED = object()
LAYOUT_CHANGES_SINCE_D429C0E = {
    "mla_eagle3": {"architectures": ["Eagle3DeepseekV2ForCausalLM"], "model_type": "deepseek_v2"},
    "dspark": {"auto_map": REMOVED},
}


def _json_bytes(config: dict) -> bytes:
    """``config.json`` as the exporter writes it."""
    return (json.dumps(config, indent=2) + "\n").encode()


def test_benchmarks_import_nothing_from_the_tests():
    # Tests may build on the benchmarks' shared pieces (tiny targets, the NeMo adapter), not the reverse.
    found = []
    for path in sorted((ROOT / "benchmarks").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            found += [
                f"{path.name}: {name}" for name in names if name == "tests" or name.startswith("tests.")
            ]
    assert len(list((ROOT / "benchmarks").glob("*.py"))) > 10
    assert not found, found
