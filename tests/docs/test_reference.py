"""The CLI reference is generated from the parsers: every option of every subcommand is on its page, as
the installed command prints it (``docs/hooks.py``, which ``mkdocs build`` runs)."""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_drafts.cli.main import ARGPARSE_COMMANDS, SUBCOMMANDS, argparse_parser
from lightning_drafts.registry import REGISTRY
from tests.families.probe import PROBE

ROOT = Path(__file__).resolve().parents[2]


def test_the_cli_page_renders_every_subcommand(hooks):
    page = (ROOT / "docs" / "reference" / "cli.md").read_text()
    rendered = hooks.on_page_markdown(page, None, None, None)
    assert "<!-- cli:" not in rendered
    for command in SUBCOMMANDS:
        assert f"$ lightning-drafts {command} --help" in rendered, command


@pytest.mark.parametrize("command", sorted(ARGPARSE_COMMANDS))
def test_every_option_of_an_argparse_subcommand_is_in_its_reference(hooks, command):
    text = hooks.cli_help(command)
    options = [o for action in argparse_parser(command)._actions for o in action.option_strings]
    assert options, command
    missing = [o for o in options if o not in text]
    assert not missing, f"lightning-drafts {command}: {missing} missing from the reference"


def test_the_fit_reference_lists_the_trainer_and_the_model(hooks):
    text = hooks.cli_help("fit")
    for option in ("--config", "--trainer.max_steps", "--model", "--data", "--ckpt_path"):
        assert option in text, option


def test_the_reference_pages_list_every_registered_module_class_a_new_family_included(hooks):
    # The probe family stands in for a family added by a user: registered, it is on both pages unedited.
    REGISTRY.register(PROBE)
    try:
        pages = {
            name: (ROOT / "docs" / "reference" / f"{name}.md").read_text()
            for name in ("hyperparameters", "api")
        }
        rendered = {name: hooks.on_page_markdown(page, None, None, None) for name, page in pages.items()}
    finally:
        REGISTRY.unregister(PROBE)
    classes = [module for family in (*REGISTRY.families, PROBE) for module in family.modules]
    assert len(classes) == 6
    for module in classes:
        path = f"{module.__module__}.{module.__qualname__}"
        assert f"## {module.__name__}\n\nArguments of `{path}`" in rendered["hyperparameters"], path
        assert f"::: {path}" in rendered["api"], path
