"""``lightning-drafts regenerate``: rewrite a fit config's answers with its own target.

Examples::

    lightning-drafts regenerate --config configs/quickstart/eagle3.yaml --output answers.jsonl
    lightning-drafts regenerate --config FIT.yaml --output answers.jsonl --resume          # after a kill
    lightning-drafts regenerate --config FIT.yaml --output answers.jsonl --worker 0/2      # two workers,
    lightning-drafts regenerate --config FIT.yaml --output answers.jsonl --worker 1/2      # then
    lightning-drafts regenerate --config FIT.yaml --output answers.jsonl --merge 2
    lightning-drafts regenerate --config FIT.yaml --output answers.jsonl --engine vllm --batch-size 256
    lightning-drafts regenerate --config FIT.yaml --check 16                               # data match only

Then train on the output: ``lightning-drafts fit --config FIT.yaml --data.init_args.data_files answers.jsonl``.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from lightning_drafts.cli.arguments import CommandParser, positive_int
from lightning_drafts.cli.fit_config import config_datamodule, read_config_with_overrides, target_spec
from lightning_drafts.serving.progress import announce


def regenerate_main(args: list[str]) -> None:
    parsed, overrides = build_parser().parse_known_args(args)
    # Merging reads only the workers' files: no target, tokenizer or data to load.
    if parsed.merge is not None:
        from lightning_drafts.workflows.regenerate import merge_shards

        meta = merge_shards(parsed.output, parsed.merge, overwrite=parsed.overwrite)
        print(f"wrote {parsed.output} ({meta['counts']['rows_written']} rows)")
        return
    config = read_config_with_overrides(parsed.config, overrides)
    spec, seed = target_spec(parsed.target, config)
    if spec is None:
        raise SystemExit(f"{parsed.config} names no model.init_args.target; pass --target")
    data_options: dict[str, Any] = {"setup_summary": False}
    if parsed.limit is not None:
        data_options["max_documents"] = parsed.limit
    if parsed.cache_dir is not None:
        data_options["cache_dir"] = parsed.cache_dir
    announce(f"regenerate: reading the data of {parsed.config}")
    datamodule = config_datamodule(config, **data_options)

    import torch

    from lightning_drafts.training.target import FrozenTarget

    def frozen_target() -> FrozenTarget:
        announce(f"regenerate: loading the target ({_describe(spec)})")
        return FrozenTarget(spec, dtype=parsed.target_dtype, seed=seed or 0).to(parsed.device)

    if parsed.check is not None:
        target = frozen_target()
        from lightning_drafts.training.data_match import target_match

        datamodule.setup("fit")
        result = target_match(target, datamodule.train_documents, parsed.check)
        print(f"data match: {result.describe()}")
        return
    if parsed.output is None:
        raise SystemExit("--output FILE.jsonl is required (or --check N to measure the data match only)")
    from lightning_drafts.serving.generate import AnswerSampling, TransformersEngine
    from lightning_drafts.workflows.regenerate import RegenerateOptions, regenerate, shard_path

    torch.manual_seed(parsed.seed)
    worker, workers = _worker(parsed.worker)
    tokenizer = datamodule.tokenizer
    stops = [tokenizer.eos_token_id, *(parsed.stop_token_id or [])]
    stops = [t for t in stops if t is not None]
    if parsed.engine == "vllm":
        from transformers import AutoConfig

        from lightning_drafts.serving.generate import VLLMEngine
        from lightning_drafts.shipped import resolve_shipped

        if not isinstance(spec, str):
            raise SystemExit("--engine vllm serves a target directory or hub id, not a config-dict target")
        directory = resolve_shipped(spec)
        engine: Any = VLLMEngine(directory, stops, parsed.vllm_python)
        target_config = AutoConfig.from_pretrained(directory)
    else:
        engine = TransformersEngine(frozen_target().model, datamodule.pad_token_id, stops)
        target_config = engine.model.config
    options = RegenerateOptions(
        sampling=AnswerSampling(parsed.temperature, parsed.top_p, parsed.max_new_tokens, parsed.seed),
        thinking=parsed.thinking,
        batch_size=parsed.batch_size,
        max_prompt_tokens=parsed.max_prompt_tokens,
        context_tokens=getattr(target_config, "max_position_embeddings", None),
        max_conversation_tokens=_conversation_bound(parsed.max_conversation_tokens, datamodule),
        tool_calls=parsed.tool_calls,
    )
    output = parsed.output if workers == 1 else shard_path(parsed.output, worker, workers)
    try:
        meta = regenerate(
            datamodule,
            engine,
            output,
            options,
            provenance={"target": _describe(spec), "engine": parsed.engine},
            resume=parsed.resume,
            overwrite=parsed.overwrite,
            worker=(worker, workers),
        )
    finally:
        if parsed.engine == "vllm":
            engine.close()  # the engine process stops with the run, also when it fails
    counts = meta["counts"]
    print(
        f"wrote {output}: {counts['rows_written']} rows, {counts['generated_tokens']:,} generated tokens, "
        f"skipped {counts['skipped']}, ended early {counts['ended_early']}, "
        f"{counts['tool_call_turns_kept']} tool-call turns and {counts['tool_results_kept']} tool results kept "
        "as recorded"
    )


def _conversation_bound(given: int | None, datamodule: Any) -> int | None:
    """``--max-conversation-tokens``; by default the data's ``max_tokens`` where training truncates
    documents there (``long_documents: drop`` drops them whole: no turn of them would be trained on)."""
    if given is not None:
        return given or None
    return datamodule.max_tokens if datamodule.long_documents == "truncate" else None


def _worker(text: str) -> tuple[int, int]:
    try:
        worker, workers = (int(part) for part in text.split("/"))
    except ValueError:
        raise SystemExit(f"--worker {text!r}: write I/N, e.g. 0/2 for the first of two workers") from None
    return worker, workers


def _describe(spec: Any) -> Any:
    """What the metadata records of the target: its id / path, or the config dict's hash."""
    if isinstance(spec, dict):
        import hashlib

        return {"config_sha256": hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]}
    return str(spec)


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(
        prog="lightning-drafts regenerate",
        description="Rewrite every assistant turn of a fit config's data with the config's own target.",
    )
    parser.add_argument("--config", required=True, help="the fit config (its model.target and data)")
    parser.add_argument("--output", help="the JSON Lines file to write (OpenAI messages rows)")
    parser.add_argument("--target", help="a target other than the config's (id, path or config file)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--max-new-tokens", type=positive_int, default=256, help="per assistant turn")
    parser.add_argument(
        "--max-prompt-tokens", type=positive_int, default=4096, help="longer prompts are skipped, counted"
    )
    parser.add_argument(
        "--max-conversation-tokens",
        type=int,
        default=None,
        help="end a conversation at the turn whose prompt reaches N tokens (default: the config's data "
        "max_tokens, where training truncates it; 0: only the target's context bounds it)",
    )
    parser.add_argument(
        "--thinking", choices=["on", "off", "both"], help="enable_thinking of templates that have it"
    )
    parser.add_argument(
        "--tool-calls",
        choices=["keep", "skip"],
        default="keep",
        help="conversations with tool calls: keep the recorded calls and results and regenerate the text "
        "answers (default), or skip them",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch-size", type=positive_int, default=8, help="conversations generated together")
    parser.add_argument("--stop-token-id", type=int, action="append", help="extra ids that end a turn")
    parser.add_argument("--limit", type=positive_int, help="only the first N rows of the data")
    parser.add_argument("--worker", default="0/1", help="I/N: this worker's share of N (then --merge N)")
    parser.add_argument(
        "--merge", type=positive_int, metavar="N", help="merge the N workers' files into --output"
    )
    parser.add_argument("--resume", action="store_true", help="continue a killed run's --output")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --output")
    parser.add_argument(
        "--check", type=positive_int, metavar="N", help="only print the data match over N documents"
    )
    parser.add_argument(
        "--engine",
        choices=["transformers", "vllm"],
        default="transformers",
        help="vllm: a real vLLM engine, kept running for the whole run (its environment: .ci/vllm-env)",
    )
    parser.add_argument(
        "--vllm-python", help="the vLLM environment's python (default: found as evaluate finds it)"
    )
    parser.add_argument("--target-dtype", default=None)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--cache-dir", default=None)
    return parser
