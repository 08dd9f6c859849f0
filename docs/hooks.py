"""MkDocs hooks: the reference pages are generated from the code at build time, never copied.

A page writes a directive on a line of its own; the hook replaces it:

* ``<!-- cli: SUBCOMMAND -->``: the ``--help`` of ``lightning-drafts SUBCOMMAND`` (``main`` for the
  command itself), from its argparse or LightningCLI parser;
* ``<!-- hyperparameters: package.Class -->``: a table of ``Class.__init__``'s arguments, their types and
  defaults from the signature, and their meaning from the class docstring's ``Args:`` section;
* ``<!-- readme -->`` as a whole page: the repository's README (the home page);
* ``<!-- include: path/FILE.md -->`` or ``<!-- include: path/FILE.md#Heading text -->``: a recorded
  results file of the repository (or one section of it, headings demoted under the page's own);
* ``<!-- code: path/FILE language -->``: a repository file verbatim in a fenced block;
* ``<!-- modules: FOLDER -->``: a table of the folder's Python files (not its subfolders), each with the
  first line of its module docstring;
* ``<!-- registry: hyperparameters -->`` / ``<!-- registry: api -->``: for every module class of every
  family in ``lightning_drafts.registry.REGISTRY``, its hyperparameters table under its name, or its
  mkdocstrings block: a new family's pages need no edit here.
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import inspect
import io
import os
import re
import sys
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README_DIRECTIVE = "<!-- readme -->"
SPHINX_ROLE = re.compile(r":(?:mod|class|func|meth|data|attr):`~?([^`]+)`")
DIRECTIVE = re.compile(r"^<!-- (cli|hyperparameters|include|code|modules|registry): (.+?) -->$", re.MULTILINE)


def on_page_markdown(markdown: str, page, config, files) -> str:  # noqa: ARG001 (MkDocs' signature)
    if markdown.strip() == README_DIRECTIVE:
        markdown = readme()
    return DIRECTIVE.sub(lambda m: RENDERERS[m.group(1)](m.group(2)), markdown)


def readme() -> str:
    """The repository's README as the site's home page: its links into docs/ made relative to the site."""
    return (ROOT / "README.md").read_text().replace("](docs/", "](")


@cache
def cli_help(command: str) -> str:
    """The help text of ``lightning-drafts COMMAND`` as the command prints it."""
    os.environ["COLUMNS"] = "110"  # argparse and jsonargparse wrap at the terminal width
    from lightning_drafts.cli.main import ARGPARSE_COMMANDS, USAGE, argparse_parser, run_cli

    if command == "main":
        text = USAGE
    elif command in ARGPARSE_COMMANDS:
        text = argparse_parser(command).format_help()
    else:
        out, argv = io.StringIO(), sys.argv
        sys.argv = ["lightning-drafts"]  # LightningCLI would read mkdocs' own arguments too
        try:
            with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
                run_cli([command, "--help"])
        finally:
            sys.argv = argv
        text = out.getvalue()
    if not text.strip():
        raise RuntimeError(f"lightning-drafts {command} --help printed nothing")
    return f"```text\n$ lightning-drafts {'' if command == 'main' else command + ' '}--help\n{text.rstrip()}\n```"


@cache
def hyperparameters(path: str) -> str:
    """The arguments of a class's ``__init__`` and of the base classes it forwards ``**kwargs`` to; a
    meaning comes from the first class in the MRO whose docstring documents that argument."""
    module_name, _, name = path.rpartition(".")
    cls = getattr(importlib.import_module(module_name), name)
    ours = [k for k in cls.__mro__ if "__init__" in vars(k) and k.__module__.startswith("lightning_drafts")]
    meanings: dict[str, str] = {}
    for klass in ours:
        for key, value in _arg_docs(klass).items():
            meanings.setdefault(key, value)
    rows, seen = [], set()
    for klass in ours:
        parameters = list(inspect.signature(klass.__init__).parameters.values())[1:]
        for parameter in parameters:
            if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD) or parameter.name in seen:
                continue
            seen.add(parameter.name)
            default = (
                "required" if parameter.default is inspect.Parameter.empty else f"`{parameter.default!r}`"
            )
            annotation = parameter.annotation if isinstance(parameter.annotation, str) else ""
            meaning = SPHINX_ROLE.sub(r"`\1`", " ".join(meanings.get(parameter.name, "").split()))
            # No code span around the type: inside one, the escaped "|" of "int | None" would show as "\\|".
            rows.append((f"`{parameter.name}`", annotation, default, meaning))
        if not any(p.kind == p.VAR_KEYWORD for p in parameters):
            break  # nothing is forwarded to the base classes
    header = f"Arguments of `{path}` (from its signature and docstring):\n\n"
    return (
        header
        + "| name | type | default | meaning |\n|---|---|---|---|\n"
        + "\n".join(_row(cells) for cells in rows)
    )


def _row(cells: tuple[str, ...]) -> str:
    """A Markdown table row; a ``|`` inside a cell (``int | None``) is escaped."""
    return "| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |"


def _arg_docs(klass: type) -> dict[str, str]:
    """``name -> meaning`` from the ``Args:`` section of the class's (or its ``__init__``'s) docstring; an
    entry may document several names at once (``kl_scale, kl_decay: ...``)."""
    from griffe import Docstring  # the docs extra's (mkdocstrings); the CLI pages need none of it

    found: dict[str, str] = {}
    for source in (vars(klass)["__init__"].__doc__, klass.__doc__):
        if not source:
            continue
        for section in Docstring(inspect.cleandoc(source)).parse("google", warnings=False):
            if section.kind.value == "parameters":
                for item in section.value:
                    for name in item.name.split(","):
                        found.setdefault(name.strip().lstrip("*"), item.description)
    return found


@cache
def include(spec: str) -> str:
    """A repository Markdown file (less its title), or the section under one of its headings."""
    relative, _, heading = spec.partition("#")
    text = (ROOT / relative).read_text()
    if heading:
        match = re.search(rf"^(#+) {re.escape(heading)}\s*$", text, re.MULTILINE)
        if match is None:
            raise ValueError(f"{relative} has no heading {heading!r}")
        level = len(match.group(1))
        rest = text[match.end() :]
        end = re.search(rf"^#{{1,{level}}} ", rest, re.MULTILINE)
        text = rest[: end.start()] if end else rest
    else:
        text = re.sub(r"\A# .*\n", "", text)  # the file's title: the page has its own
    # Included under a page section (##): the file's headings go two levels down.
    return re.sub(r"^(#+) ", lambda m: "##" + m.group(1) + " ", text, flags=re.MULTILINE).strip()


@cache
def code(spec: str) -> str:
    """A repository file shown verbatim in a fenced block: ``path language``."""
    relative, _, language = spec.partition(" ")
    return f"````{language}\n{(ROOT / relative).read_text().rstrip()}\n````"


@cache
def modules(folder: str) -> str:
    """The folder's source files and what each holds, from the first line of its module docstring."""
    rows = ["| file | what it holds |", "|---|---|"]
    for path in sorted((ROOT / folder).glob("*.py")):
        docstring = ast.get_docstring(ast.parse(path.read_text()))
        # The first paragraph: a summary line is often wrapped onto the next.
        first = " ".join(docstring.strip().split("\n\n")[0].split()) if docstring else ""
        if not first:
            raise ValueError(
                f"{folder}/{path.name} has no module docstring: the architecture page lists it by one"
            )
        rows.append(_row((f"`{path.name}`", SPHINX_ROLE.sub(r"`\1`", first))))
    return "\n".join(rows)


def registry(what: str) -> str:
    """Every registered family's module classes: their hyperparameters tables or their API blocks."""
    from lightning_drafts.registry import REGISTRY

    paths = [f"{m.__module__}.{m.__qualname__}" for family in REGISTRY.families for m in family.modules]
    if what == "hyperparameters":
        return "\n\n".join(f"## {path.rpartition('.')[2]}\n\n{hyperparameters(path)}" for path in paths)
    if what == "api":
        return "\n\n".join(f"::: {path}" for path in paths)
    raise ValueError(f"<!-- registry: {what} -->: write 'hyperparameters' or 'api'")


RENDERERS = {
    "cli": cli_help,
    "hyperparameters": hyperparameters,
    "include": include,
    "code": code,
    "modules": modules,
    "registry": registry,
}
