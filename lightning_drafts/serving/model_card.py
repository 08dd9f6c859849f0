"""The model card of an export: ``README.md`` beside ``config.json``, with Hugging Face metadata, the draft's
settings, how it was trained, and the commands that serve this export with vLLM and SGLang.

``evaluate`` rewrites only the part between :data:`RESULTS_BEGIN` and :data:`RESULTS_END` (the served
acceptance and its settings); the validators read ``config.json`` and the weights, never the card.
"""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from lightning_drafts.gguf import is_gguf
from lightning_drafts.serving.export_files import CARD_FILE, CONFIG_FILE
from lightning_drafts.shipped import SHIPPED_PREFIX

if TYPE_CHECKING:
    from lightning_drafts.serving.family import DraftFamily
    from lightning_drafts.serving.report import EvaluationReport
    from lightning_drafts.training.module import DraftModule

LIBRARY_NAME = "lightning-drafts"
RESULTS_BEGIN = "<!-- lightning-drafts: served results -->"
RESULTS_END = "<!-- /lightning-drafts: served results -->"
NO_RESULTS = (
    "Not evaluated yet: `lightning-drafts evaluate DIR --config FIT.yaml` writes its served acceptance here."
)
# Heads the part of the served-results section that a smaller run writes beside the card's measurement.
SMALLER_RUN = "### A later, smaller run"
_PROMPTS_ROW = re.compile(r"^\| prompts \| ([\d,]+) from", re.MULTILINE)
_TOKENS_ROW = re.compile(r"^\| verify rounds / generated tokens \| [\d,]+ / ([\d,]+) \|", re.MULTILINE)
# hparams that say how the module was built, not what the draft is.
NOT_SETTINGS = {"target", "tokenizer_vocab_size", "pad_token_id", "token_frequencies"}


@dataclass(frozen=True)
class TrainingFacts:
    """What a checkpoint says about the training behind an export (``None``: not known)."""

    checkpoint: str | None = None
    steps: int | None = None
    epochs: int | None = None
    data_files: list[str] | None = None
    documents: int | None = None
    tokens: int | None = None
    val_accept_len: float | None = None


def family_tag(module: DraftModule) -> str:
    """The card's tag of a draft: its module class, lower case, without ``Module`` (``eagle3``,
    ``mlaeagle3``, ``dflash``, ``dflash2``, ``dspark``)."""
    return type(module).__name__.removesuffix("Module").lower()


# What the serving commands say for a target that was a folder of the training machine: its path there
# means nothing where the card is read (another machine, the hub).
TARGET_PLACEHOLDER = "TARGET_DIR"


def is_local_target(target: str) -> bool:
    """Whether ``target`` names a folder of this machine (a shipped target, an absolute path, a relative
    path that exists) rather than a hub id."""
    if target.startswith(SHIPPED_PREFIX):
        return True
    path = Path(target).expanduser()
    return path.is_absolute() or path.exists()


def served_target(target: Any) -> str:
    """The target as the card's commands give it to an engine: a hub id as recorded; a GGUF file's
    converted folder by its name (:func:`converted_folder`); :data:`TARGET_PLACEHOLDER` for a local folder,
    a config dict or a model instance (no path of the training machine goes into the card)."""
    if isinstance(target, str):
        if is_gguf(target):
            return Path(converted_folder(target)).name
        return TARGET_PLACEHOLDER if is_local_target(target) else target
    return TARGET_PLACEHOLDER


def shown_name(target: str) -> str:
    """A target or data file as the card names it: a file or folder of this machine by its name alone (the
    card is read on other machines and on the hub), anything else as given."""
    if is_local_target(target) and not target.startswith(SHIPPED_PREFIX):
        return Path(target).name
    return target


def converted_folder(gguf_file: str) -> str:
    """Where the card tells the user to convert a GGUF target (``model.gguf`` -> ``model-hf``): the engines'
    speculative decoding loads the target from a Hugging Face folder."""
    return gguf_file[: -len(".gguf")] + "-hf"


def serving_commands(
    family: DraftFamily, architecture: str, target: str, export_dir: Path, num_steps: int
) -> dict[str, str | None]:
    """The vLLM and SGLang commands that serve this export (``None``: that engine loads no such layout)."""
    commands: dict[str, str | None] = {"vLLM": None, "SGLang": None}
    if architecture in family.vllm_methods:
        spec = {"method": family.vllm_methods[architecture], "model": str(export_dir)}
        spec["num_speculative_tokens"] = num_steps
        commands["vLLM"] = (
            f"vllm serve {shlex.quote(target)} --speculative-config {shlex.quote(json.dumps(spec))}"
        )
    algorithm = family.sglang_algorithms.get(architecture)
    if algorithm is not None:
        # SGLang verifies the anchor plus the proposals: num_draft_tokens = proposals + 1 for every family.
        steps = (
            f" --speculative-num-steps {num_steps} --speculative-eagle-topk 1"
            if algorithm == "EAGLE3"
            else ""
        )
        commands["SGLang"] = (
            f"python -m sglang.launch_server --model {shlex.quote(target)} --speculative-algorithm {algorithm}"
            f" --speculative-draft-model-path {shlex.quote(str(export_dir))}{steps}"
            f" --speculative-num-draft-tokens {num_steps + 1}"
        )
    return commands


def render_card(
    module: DraftModule,
    family: DraftFamily,
    config: Mapping[str, Any],
    export_dir: Path,
    training: TrainingFacts | None = None,
) -> str:
    """The card's Markdown for ``module``'s export (``config`` is its ``config.json``)."""
    target = module.hparams.get("target")
    target_name = shown_name(target) if isinstance(target, str) else None
    architecture = config["architectures"][0]
    tags = ["speculative-decoding", family_tag(module)]
    front = {"library_name": LIBRARY_NAME, "tags": tags}
    if target_name == target:  # a hub id (or a shipped target's name): a file or folder names no base model
        front = {"base_model": target_name, **front}
    num_steps = family.default_num_steps(dict(config))
    # The export by its folder's name: the commands run from the directory that holds it.
    draft = Path(export_dir.resolve().name)
    commands = serving_commands(family, architecture, served_target(target), draft, num_steps)
    settings = {k: v for k, v in module.hparams.items() if not k.startswith("_") and k not in NOT_SETTINGS}

    lines = ["---", yaml.safe_dump(front, sort_keys=False).strip(), "---", ""]
    lines += [f"# {family.name} draft ({type(module).__name__}) for {target_name or 'its target'}", ""]
    lines += [
        f"A speculative-decoding draft trained with {LIBRARY_NAME} against the frozen target "
        f"`{target_name or 'given as a model instance or config dict'}`. Layout: `{architecture}` "
        f"(`config.json` + `model.safetensors`); it drafts {num_steps} tokens a round by default.",
        "",
        "## Draft settings",
        "",
        "| setting | value |",
        "|---|---|",
        *(f"| `{name}` | `{json.dumps(value, default=str)}` |" for name, value in settings.items()),
        "",
        "## Training",
        "",
        *_training_lines(training),
        "",
        "## Serve it",
        "",
    ]
    for engine, command in commands.items():
        if command is None:
            lines += [f"{engine}: this layout is not one {engine} loads.", ""]
        else:
            lines += [f"{engine}:", "", "```bash", command, "```", ""]
    lines += [
        f"`{draft}`: this export's folder (run the commands from the directory that holds it, or give its path "
        "or hub id instead).",
        "",
    ]
    if not isinstance(target, str):
        lines += [
            f"`{TARGET_PLACEHOLDER}`: the target saved with `save_pretrained` (it was not given by id or path).",
            "",
        ]
    elif is_gguf(target):
        gguf, folder = Path(target).name, served_target(target)
        lines += [
            f"`{folder}`: the GGUF target `{gguf}` written as a Hugging Face folder, which the engines "
            f"load: `lightning-drafts convert-gguf {shlex.quote(gguf)} {shlex.quote(folder)}`.",
            "",
        ]
    elif target.startswith(SHIPPED_PREFIX):
        lines += [
            f"`{TARGET_PLACEHOLDER}`: the folder of the shipped target `{target}`, printed by "
            f"`python -c 'from lightning_drafts.shipped import resolve_shipped; print(resolve_shipped(\"{target}\"))'`.",
            "",
        ]
    elif is_local_target(target):
        lines += [f"`{TARGET_PLACEHOLDER}`: the target's folder (`{Path(target).name}` in training).", ""]
    lines += ["## Served acceptance", "", RESULTS_BEGIN, NO_RESULTS, RESULTS_END, ""]
    return "\n".join(lines)


def _training_lines(training: TrainingFacts | None) -> list[str]:
    if training is None:
        return ["Exported from a module in memory: no checkpoint recorded its training."]
    data = (
        "the embedded chitchat-dataset corpus"
        if training.data_files == []
        else ", ".join(f"`{shown_name(f)}`" for f in training.data_files)
        if training.data_files
        else "not recorded (no config.yaml beside the checkpoint's directory)"
    )
    rows = [
        ("checkpoint", f"`{training.checkpoint}`" if training.checkpoint else None),
        ("optimizer steps", training.steps),
        ("epochs completed", training.epochs),
        ("training data", data),
        ("documents / tokens in the training split", _pair(training.documents, training.tokens)),
        (
            "`val/accept_len` at this checkpoint",
            f"{training.val_accept_len:.3f}" if training.val_accept_len is not None else "not recorded",
        ),
    ]
    return ["| | |", "|---|---|", *(f"| {name} | {value} |" for name, value in rows if value is not None)]


def _pair(first: int | None, second: int | None) -> str | None:
    return None if first is None or second is None else f"{first:,} / {second:,}"


def write_card(
    module: DraftModule,
    family: DraftFamily,
    directory: str | Path,
    export_dir: str | Path | None = None,
    training: TrainingFacts | None = None,
) -> Path:
    """Write ``README.md`` into ``directory`` (an export's files, maybe staged); the serving commands name
    ``export_dir`` (where the export will live; default ``directory``)."""
    directory = Path(directory)
    config = json.loads((directory / CONFIG_FILE).read_text())
    text = render_card(module, family, config, Path(export_dir or directory), training)
    path = directory / CARD_FILE
    path.write_text(text)
    path.chmod(0o644)
    return path


def read_card(directory: str | Path) -> tuple[dict[str, Any], str]:
    """An export's card: its metadata (the front matter) and its Markdown body."""
    path = Path(directory) / CARD_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"{directory} has no {CARD_FILE}; export it again with `lightning-drafts export`"
        )
    text = path.read_text()
    _, front, body = text.split("---\n", 2) if text.startswith("---\n") else ("", "", text)
    return (yaml.safe_load(front) or {}), body


def has_card(directory: str | Path) -> bool:
    """Whether ``directory`` holds a model card this project wrote (one with a served-results section)."""
    path = Path(directory) / CARD_FILE
    return path.is_file() and RESULTS_BEGIN in (text := path.read_text()) and RESULTS_END in text


def update_results(directory: str | Path, results: str) -> Path:
    """Replace the card's served-acceptance section with ``results`` (Markdown)."""
    path = Path(directory) / CARD_FILE
    text = path.read_text() if path.is_file() else ""
    if RESULTS_BEGIN not in text or RESULTS_END not in text:
        raise ValueError(
            f"{path} is not a lightning-drafts model card (no served-results section); export the checkpoint "
            "again to write one"
        )
    head, rest = text.split(RESULTS_BEGIN, 1)
    tail = rest.split(RESULTS_END, 1)[1]
    path.write_text(f"{head}{RESULTS_BEGIN}\n{results.strip()}\n{RESULTS_END}{tail}")
    return path


def record_results(directory: str | Path, report: EvaluationReport, prompts: str) -> str:
    """Write ``report``'s served acceptance into the card of ``directory``, and say what was done.

    A run with at least as many prompts and generated tokens as the card's measurement replaces it (and
    any smaller run kept beside it). A smaller one (a quick check on one prompt) leaves the measurement
    in place and is written beside it, under :data:`SMALLER_RUN`, so a throw-away run never replaces a
    measurement that took an hour; the card says which is which.
    """
    path = Path(directory) / CARD_FILE
    section = results_section(report, prompts)
    earlier = _current_results(path).split(SMALLER_RUN, 1)[0].strip()
    measured = _measured(earlier)
    size = f"{report.num_prompts:,} prompts, {report.generated_tokens:,} tokens"
    if measured is None or (report.num_prompts >= measured[0] and report.generated_tokens >= measured[1]):
        update_results(directory, section)
        return f"updated {path} with this run's served acceptance ({size})"
    kept = f"{measured[0]:,} prompts, {measured[1]:,} tokens"
    beside = (
        f"{SMALLER_RUN} ({size})\n\nThis run measured fewer prompts or tokens than the one above ({kept}), "
        "which stays this card's served acceptance; a run with at least as many prompts and tokens replaces "
        f"both.\n\n{section}"
    )
    update_results(directory, f"{earlier}\n\n{beside}")
    return (
        f"kept the served acceptance of {path} measured on {kept} and wrote this smaller run ({size}) beside "
        "it; run at least as many prompts and tokens to replace it"
    )


def _current_results(path: Path) -> str:
    text = path.read_text() if path.is_file() else ""
    if RESULTS_BEGIN not in text or RESULTS_END not in text:
        return ""
    return text.split(RESULTS_BEGIN, 1)[1].split(RESULTS_END, 1)[0]


def _measured(section: str) -> tuple[int, int] | None:
    """``(prompts, generated tokens)`` of a served-results section, or ``None`` when it holds none."""
    prompts, tokens = _PROMPTS_ROW.search(section), _TOKENS_ROW.search(section)
    if prompts is None or tokens is None:
        return None
    return int(prompts.group(1).replace(",", "")), int(tokens.group(1).replace(",", ""))


def results_section(report: EvaluationReport, prompts: str) -> str:
    """The card's served-acceptance section for ``report``; ``prompts`` says where its prompts came from."""
    training = report.training.accept_len if report.training is not None else None
    lossless = {True: "yes", False: "NO", None: "not checked"}[report.lossless]
    rows = [
        ("served `accept_len`, pooled over tokens (vLLM, SGLang)", _number(report.served.accept_len)),
        ("served `accept_len`, per-request mean (SpecForge)", _number(report.served.accept_len_per_request)),
        ("training estimate (tau_sim) on the same tokens", _number(training)),
        (
            "accepted per drafted position (prefix rate)",
            ", ".join(f"{r:.3f}" for r in report.served.prefix_rate),
        ),
        ("verify rounds / generated tokens", f"{report.rounds:,} / {report.generated_tokens:,}"),
        ("engine", report.engine),
        ("decoding", report.decoding()),
        ("prompts", f"{report.num_prompts} from {prompts}"),
        ("tokens drafted per round (`num_steps`)", report.num_steps),
        ("new tokens per prompt (`max_new_tokens`)", report.max_new_tokens),
        ("output equal to the target's greedy decode", lossless),
    ]
    lines = ["| | |", "|---|---|", *(f"| {name} | {value} |" for name, value in rows)]
    if report.table:
        lines += ["", "Per prompt set and category:", "", report.markdown()]
    return "\n".join(lines)


def _number(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"
