"""``lightning-drafts evaluate``: serve an exported draft on held-out prompts and report its acceptance.

Examples::

    lightning-drafts evaluate runs/export --config configs/quickstart/eagle3.yaml --num-prompts 16
    lightning-drafts evaluate DIR --target meta-llama/Llama-3.1-8B-Instruct --prompts prompts.jsonl --json r.json
    lightning-drafts evaluate runs/export --config configs/quickstart/eagle3.yaml --engine vllm
    lightning-drafts evaluate runs/export --config configs/quickstart/eagle3.yaml --prompts mt-bench --out r/

Prompt sources, first match wins: ``--prompts`` (a shipped prompt set by name, ``mt-bench``,
``humaneval``, ``gsm8k`` or ``math-500``; a chat JSONL of user turns; or a JSONL of token ids), ``--data-files`` (chat files,
tokenised by ``lightning_drafts.datamodules.PackedChatDataModule``), ``--config`` / ``--data-config`` (a ``fit`` config:
its ``data`` section gives the same held-out split training validated on), else the embedded corpus with
the quickstart split.
"""

from __future__ import annotations

import argparse
import warnings
from pathlib import Path
from typing import Any

from torch import Tensor

from lightning_drafts.cli.arguments import CommandParser, positive_int
from lightning_drafts.cli.fit_config import read_config_with_overrides, target_spec
from lightning_drafts.serving.evaluate import ENGINES
from lightning_drafts.serving.export_files import read_export
from lightning_drafts.serving.model_card import has_card, record_results
from lightning_drafts.serving.progress import announce
from lightning_drafts.serving.prompt_sets import (
    PROMPT_SETS,
    Conversation,
    is_text_prompt_file,
    load_prompt_set,
)
from lightning_drafts.serving.prompts import load_prompts_jsonl, prompts_from_datamodule
from lightning_drafts.serving.sampling import Sampling
from lightning_drafts.serving.tree_sweep import sweep_markdown, write_sweep
from lightning_drafts.serving.vllm_engine import VLLM_PYTHON_ENV
from lightning_drafts.workflows.evaluate import evaluate_export, sweep_export

# The quickstart configs hold out this share of the embedded corpus, so the default prompts are unseen.
DEFAULT_VAL_FRACTION = 0.02
DEFAULT_NUM_PROMPTS = 8


def evaluate_main(args: list[str]) -> None:
    parsed, overrides = build_parser().parse_known_args(args)
    if overrides and not parsed.config:
        raise SystemExit(f"{overrides[0]}: config overrides need --config")
    config = read_config_with_overrides(parsed.config, overrides) if parsed.config else {}
    target, seed = target_spec(parsed.target, config)
    prompts = _prompts(parsed, config)
    conversations = bool(prompts) and isinstance(prompts[0], Conversation)
    if parsed.sweep:
        _sweep(parsed, prompts, target, seed, conversations, config)
        return
    report = evaluate_export(
        parsed.export_dir,
        prompts,
        num_steps=parsed.num_steps,
        with_training_estimate=not parsed.no_training_estimate,
        engine=parsed.engine,
        vllm_python=parsed.vllm_python,
        ngram=parsed.engine == "vllm" and not parsed.no_ngram,
        **_served_options(parsed, target, seed, conversations, config),
        topk=parsed.topk,
        num_draft_tokens=parsed.num_draft_tokens,
    )
    print(report.format_table())
    if parsed.no_card:
        pass
    elif has_card(parsed.export_dir):
        print(record_results(parsed.export_dir, report, _prompt_source(parsed)))
    else:
        print(
            f"{parsed.export_dir} has no model card (README.md) to update; `lightning-drafts export` writes one"
        )
    if parsed.json:
        print(f"wrote {report.write_json(parsed.json)}")
    if parsed.out:
        print("wrote {} and {}".format(*report.write_results(parsed.out)))
    if report.lossless is False:
        raise SystemExit("speculative decoding did not reproduce the target's greedy output (see the table)")


def _served_options(
    parsed: argparse.Namespace, target: Any, seed: int | None, conversations: bool, config: dict[str, Any]
) -> dict[str, Any]:
    """The options a single evaluation and a sweep share."""
    return {
        "target": target,
        "max_new_tokens": parsed.max_new_tokens,
        "stop_token_ids": [] if parsed.ignore_eos else None,
        "check_lossless": parsed.check_lossless,
        "target_seed": parsed.target_seed if parsed.target_seed is not None else seed,
        "target_attn_backend": parsed.target_attn_backend,
        "target_dtype": parsed.target_dtype,
        "device": parsed.device,
        "progress": True,
        "tokenizer": _tokenizer(parsed, config, target) if conversations else None,
        "baseline": not parsed.no_baseline,
        "max_prompt_tokens": parsed.max_prompt_tokens,
        "sampling": Sampling(parsed.temperature, parsed.top_p) if parsed.temperature > 0 else None,
        "seed": parsed.seed,
    }


def _sweep(
    parsed: argparse.Namespace,
    prompts: list[Tensor] | list[Conversation],
    target: Any,
    seed: int | None,
    conversations: bool,
    config: dict[str, Any],
) -> None:
    """``--sweep``: the grid of tree settings, one table; the model card is left as it is."""
    given = [name for name in ("num_steps", "topk", "num_draft_tokens") if getattr(parsed, name) is not None]
    if given:
        flags = ", ".join("--" + name.replace("_", "-") for name in given)
        raise ValueError(f"--sweep serves its own grid of tree settings; drop {flags}")
    if parsed.engine != "builtin":
        raise ValueError("--sweep runs in the built-in engine; drop --engine vllm")
    # The sweep shows no tokens/s: the target alone decodes only where later turns need its answers.
    options = {**_served_options(parsed, target, seed, conversations, config), "baseline": False}
    rows = sweep_export(parsed.export_dir, prompts, **options)
    print(sweep_markdown(rows))
    decoding = (
        "greedy" if parsed.temperature <= 0 else f"temperature {parsed.temperature}, top_p {parsed.top_p}"
    )
    title = f"Tree settings served from {parsed.export_dir} on {_prompt_source(parsed)} ({decoding}, the built-in decode)"
    if parsed.out:
        print("wrote {} and {}".format(*write_sweep(rows, parsed.out, title)))
    if any(row.lossless is False for row in rows):
        raise SystemExit("speculative decoding did not reproduce the target's greedy output (see the table)")


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(
        prog="lightning-drafts evaluate",
        description="Greedy speculative decoding from an exported draft, verified by the target: the served "
        "acceptance length beside the training-time estimate (tau_sim) on the same prompts.",
    )
    parser.add_argument("export_dir", help="an export directory (config.json + model.safetensors)")
    parser.add_argument(
        "--target",
        default=None,
        help="hub id / local path, or a JSON / YAML file holding a config dict (random tiny target) or a fit "
        "config with model.init_args.target; default: --config's, else the target the export records",
    )
    parser.add_argument(
        "--target-seed", type=int, default=None, help="seed of a config-dict target's weights"
    )
    parser.add_argument("--target-dtype", default=None, help="e.g. bfloat16 (default: the checkpoint's)")
    parser.add_argument(
        "--target-attn-backend",
        default="sdpa",
        help="sdpa (default: one sequence per forward needs no packing kernel), eager, flex, flash or auto",
    )
    parser.add_argument("--device", default=None, help="e.g. cuda:0 (default: where the target loads, CPU)")
    parser.add_argument(
        "--engine",
        choices=ENGINES,
        default="builtin",
        help="who drafts and verifies: builtin (the project's greedy decode, default) or vllm (a real vLLM "
        "engine in its own environment, see --vllm-python)",
    )
    parser.add_argument(
        "--vllm-python",
        default=None,
        help=f"python of the vLLM environment (default: ${VLLM_PYTHON_ENV}, else .venv-vllm, built by .ci/vllm-env)",
    )
    parser.add_argument("--config", default=None, help="a `lightning-drafts fit` config: its target and data")
    parser.add_argument(
        "--prompts",
        default=None,
        help=f"a shipped prompt set ({', '.join(PROMPT_SETS)}: results per category), a chat JSONL (rows "
        '{"turns": [user turns]} or {"messages": [...]}: later turns follow the target\'s own answers), or a '
        "JSONL of token-id prompts (see load_prompts_jsonl)",
    )
    parser.add_argument("--data-files", nargs="+", default=None, help="chat files for PackedChatDataModule")
    parser.add_argument(
        "--tokenizer",
        default=None,
        help="tokenizer of --data-files (default: embedded) and of text --prompts (default: --config's data "
        "tokenizer, else the target's)",
    )
    parser.add_argument(
        "--val-fraction",
        type=float,
        default=DEFAULT_VAL_FRACTION,
        help="share of --data-files held out for prompts (the quickstart's split by default)",
    )
    parser.add_argument("--cache-dir", default=None, help="tokenisation cache (default: the datasets cache)")
    parser.add_argument(
        "--num-prompts",
        type=positive_int,
        default=None,
        help=f"prompts to serve (default: a prompt set's or chat file's every conversation, else "
        f"{DEFAULT_NUM_PROMPTS})",
    )
    parser.add_argument(
        "--max-prompt-tokens",
        type=positive_int,
        default=512,
        help="keep the last N tokens of a longer prompt (how many were cut is printed)",
    )
    parser.add_argument("--max-new-tokens", type=positive_int, default=64)
    parser.add_argument(
        "--num-steps", type=positive_int, default=None, help="tokens drafted per round (family default)"
    )
    parser.add_argument(
        "--topk",
        type=positive_int,
        default=None,
        help="draft SGLang's token trees: children kept per leaf (--speculative-eagle-topk), with "
        "--num-draft-tokens; --num-steps is the depth (built-in engine, greedy)",
    )
    parser.add_argument(
        "--num-draft-tokens",
        type=positive_int,
        default=None,
        help="tree nodes the target verifies per round, the root included (--speculative-num-draft-tokens)",
    )
    parser.add_argument(
        "--sweep",
        action="store_true",
        help="serve a grid of (num_steps, topk, num_draft_tokens) tree settings on the same prompts and print "
        "(--out: write sweep.json, sweep.md) acceptance and draft tokens verified per round",
    )
    parser.add_argument("--ignore-eos", action="store_true", help="always generate --max-new-tokens tokens")
    parser.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="0 (default): greedy; > 0: sample, with speculative sampling's acceptance rule (built-in engine)",
    )
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling with --temperature")
    parser.add_argument("--seed", type=int, default=0, help="request i samples from seed + i")
    parser.add_argument("--check-lossless", action="store_true", help="also decode plainly and compare")
    parser.add_argument("--no-training-estimate", action="store_true", help="skip tau_sim")
    parser.add_argument("--json", default=None, help="also write the full report here")
    parser.add_argument(
        "--out",
        default=None,
        help="write served.json (the report) and served.md (the table) into this folder",
    )
    parser.add_argument(
        "--no-baseline",
        action="store_true",
        help="skip decoding with the target alone (no tokens/s without speculation; multi-turn sets need it)",
    )
    parser.add_argument(
        "--no-ngram", action="store_true", help="with --engine vllm, skip vLLM's n-gram speculator"
    )
    parser.add_argument(
        "--no-card", action="store_true", help="leave the export's README.md (its model card) as it is"
    )
    return parser


def _prompt_source(parsed: argparse.Namespace) -> str:
    """Where the prompts came from, in the words of the model card (the first source that applies). Files
    are named without their folders: the card travels with the export, the evaluating machine's paths not."""
    if parsed.prompts in PROMPT_SETS:
        return f"the shipped `{parsed.prompts}` set"
    if parsed.prompts:
        return f"`{Path(parsed.prompts).name}`"
    if parsed.data_files:
        names = ", ".join(f"`{Path(f).name}`" for f in parsed.data_files)
        return f"the held-out {parsed.val_fraction:.0%} of {names}"
    if parsed.config:
        return f"the validation split of `{Path(parsed.config).name}`"
    return "the embedded corpus (the quickstart split)"


def _prompts(parsed: argparse.Namespace, config: dict[str, Any]) -> list[Tensor] | list[Conversation]:
    if parsed.prompts in PROMPT_SETS or (parsed.prompts and is_text_prompt_file(parsed.prompts)):
        conversations = load_prompt_set(parsed.prompts, parsed.num_prompts)  # None: the whole set
        announce(f"evaluate: {_count(len(conversations), 'conversation')} of {parsed.prompts}")
        return conversations
    limit = parsed.num_prompts or DEFAULT_NUM_PROMPTS
    if parsed.prompts:
        prompts = load_prompts_jsonl(parsed.prompts, limit)
        announce(f"evaluate: {_count(len(prompts), 'prompt')} from {parsed.prompts}")
        return prompts  # cut to --max-prompt-tokens by the evaluation, which counts the prompts it cuts
    datamodule = _datamodule(config, parsed)
    source = parsed.data_files or (config.get("data") and parsed.config) or "the embedded corpus"
    announce(f"evaluate: tokenising the held-out prompts of {source}")
    prompts = prompts_from_datamodule(datamodule, limit)
    announce(f"evaluate: {_count(len(prompts), 'prompt')}")
    return prompts


def _tokenizer(parsed: argparse.Namespace, config: dict[str, Any], target: Any) -> Any:
    """The tokenizer that renders text prompts: ``--tokenizer``, the config's data tokenizer (with its chat
    template), else the target's own (the target given, or the one the export records)."""
    from lightning_drafts.datamodules.templates import resolve_chat_template
    from lightning_drafts.datamodules.tokenizer_files import load_tokenizer

    data = dict(((config.get("data") or {}).get("init_args")) or {})
    spec = parsed.tokenizer or data.get("tokenizer") or target
    if spec is None:
        spec = (read_export(parsed.export_dir).config.get("lightning_drafts") or {}).get("target")
    if not isinstance(spec, str):
        raise ValueError(
            "text prompts need a tokenizer with a chat template and the target is not a hub id or path; "
            "pass --tokenizer"
        )
    option = (
        "--tokenizer"
        if parsed.tokenizer
        else "data.init_args.tokenizer"
        if data.get("tokenizer")
        else "--target"
    )
    tokenizer = load_tokenizer(spec, option)
    template = data.get("chat_template") if parsed.tokenizer is None else None
    tokenizer.chat_template = resolve_chat_template(template, tokenizer)
    return tokenizer


def _datamodule(config: dict[str, Any], parsed: argparse.Namespace | None = None) -> Any:
    """The fit config's ``PackedChatDataModule`` (same split), or one over ``--data-files`` / the embedded corpus."""
    from lightning_drafts.datamodules import PackedChatDataModule

    init_args = dict(((config.get("data") or {}).get("init_args")) or {})
    if parsed is not None and parsed.data_files is not None:
        # New chat files, tokenised as the config's training was (its tokenizer and chat template).
        init_args = {
            "data_files": parsed.data_files,
            "tokenizer": parsed.tokenizer or init_args.get("tokenizer"),
            # The config's template belongs to the config's tokenizer: kept only with it.
            **(
                {"chat_template": init_args["chat_template"]}
                if init_args.get("chat_template") and parsed.tokenizer is None
                else {}
            ),
            "val_fraction": parsed.val_fraction,
        }
    elif (
        parsed is not None
        and config.get("data") is not None
        and not (init_args.get("val_data_files") or init_args.get("val_fraction"))
    ):
        warnings.warn(
            f"the --config data has no validation split: prompts come from a {DEFAULT_VAL_FRACTION:.0%} slice of "
            "documents the draft trained on; pass --data-files or --prompts for held-out prompts",
            stacklevel=2,
        )
    if init_args.get("val_data_files") is None and not init_args.get("val_fraction"):
        init_args["val_fraction"] = DEFAULT_VAL_FRACTION
    # The prompts are what matters here: no training summary or sample (its warnings still print).
    init_args["setup_summary"] = False
    if parsed is not None and parsed.cache_dir is not None:
        init_args["cache_dir"] = parsed.cache_dir
    return PackedChatDataModule(**init_args)


def _count(number: int, noun: str) -> str:
    return f"{number:,} {noun}{'' if number == 1 else 's'}"
