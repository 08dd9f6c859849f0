"""Greedy (speculative) decoding of token-id prompts by a real vLLM engine, as a standalone script.

It runs in vLLM's own Python environment, where this project is not installed, so it imports only vLLM,
tqdm (which vLLM ships with) and the standard library, never ``lightning_drafts``. The project side is
:mod:`lightning_drafts.serving.vllm_engine`, which writes the request, launches
``python vllm_runner.py REQUEST.json RESULT.json`` and reads the result, or keeps one engine running with
``python vllm_runner.py --serve ENGINE.json REPLY_FD`` (:class:`~lightning_drafts.serving.vllm_engine.VLLMSession`).

Request (JSON object):
    target: a directory (or hub id) vLLM loads as the target model.
    draft: the exported draft directory, or null for the target's plain greedy decode.
    method: vLLM's speculative method (``eagle3``, ``dflash``, ...); ignored without a draft.
    num_speculative_tokens: tokens drafted per round.
    prompts: lists of token ids.
    max_new_tokens: tokens generated per prompt (at most).
    ignore_eos: do not stop at the target's end-of-sequence token.
    stop_token_ids: stop after any of these (the stop token is kept, as the built-in decode keeps it).
    dtype: vLLM's ``dtype`` (default ``float32``).
    progress: show vLLM's progress bar (on stdout).
    max_model_len: optional; vLLM's context limit (default: the target config's).

Result (JSON object): ``vllm_version``; ``generations`` (token ids per prompt); ``rounds`` and
``accepted_per_position`` (vLLM's ``spec_decode_num_drafts`` and ``spec_decode_num_accepted_tokens_per_pos``
counters); ``per_request`` (per prompt, the accepted and drafted count of every verify round, from vLLM's
detailed per-request metrics); ``seconds`` (engine start, generation).

Serve mode: ENGINE.json holds ``target`` (and optionally ``dtype``, ``max_model_len``); the engine starts
once, then every line on stdin is a JSON call ``{"prompts", "max_new_tokens", "stop_token_ids",
"temperature", "top_p", "seeds"}`` (``seeds``: one per prompt, or null) and its answer, one JSON line
``{"generations"}`` or ``{"error"}``, is written to the file descriptor REPLY_FD (stdout is not used for it:
vLLM and its libraries may print there). A first line ``{"ready": true}`` says the engine has started.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

# Offline LLM(...) must not spawn an engine process that re-imports this script without a __main__ guard,
# and the KV cache of a tiny model needs little memory; both are set here as well as by the caller so that
# the script also runs by hand.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
# stdout carries the progress bar only; vLLM's log (stdout by default) goes to stderr.
os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")

REQUIRED = ("target", "prompts", "max_new_tokens")
# vLLM's name of its reference MLA backend on CPU.
REFERENCE_CPU_MLA = "CPU_MLA"


def _engine_arguments(request: dict[str, Any]) -> dict[str, Any]:
    arguments: dict[str, Any] = {
        "model": request["target"],
        "dtype": request.get("dtype", "float32"),
        "enforce_eager": True,
        # Prompts are token ids and outputs are read as ids: no tokenizer is needed or loaded.
        "skip_tokenizer_init": True,
        "seed": 0,
        # A prompt repeating an earlier one's prefix would reuse that request's cached KV (target and draft):
        # every prompt is served from scratch, as the built-in decode serves it, so no result depends on order.
        "enable_prefix_caching": False,
        # The spec-decode counters (rounds, accepted per position) live in the engine's stat loggers.
        "disable_log_stats": False,
    }
    if request.get("max_model_len") is not None:
        arguments["max_model_len"] = int(request["max_model_len"])
    # On a CPU with AMX tiles vLLM's CPU build prefers its AMX MLA backend, whose kernels take bfloat16,
    # float16 or int8 weights only: a float32 MLA target or draft then fails to load ("expect weight to be
    # bfloat16, ..."). Its reference CPU MLA backend serves every dtype; the draft chooses its own.
    if _needs_reference_cpu_mla(request["target"], arguments["dtype"]):
        arguments["attention_config"] = {"backend": REFERENCE_CPU_MLA}
    if request.get("draft") is not None:
        arguments["speculative_config"] = {
            "method": request["method"],
            "model": request["draft"],
            "num_speculative_tokens": int(request["num_speculative_tokens"]),
        }
        if _needs_reference_cpu_mla(request["draft"], arguments["dtype"]):
            arguments["speculative_config"]["attention_backend"] = REFERENCE_CPU_MLA
        # Per-request, per-round accepted / drafted counts ("detailed"): the report needs rounds per prompt.
        arguments["per_request_spec_decode_metrics"] = "detailed"
    return arguments


def _needs_reference_cpu_mla(model: str, dtype: str) -> bool:
    """Whether vLLM (on CPU) must be told to serve the MLA model in directory ``model`` with its reference
    backend."""
    if dtype not in ("float32", "torch.float32"):
        return False
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return False
    config = Path(model) / "config.json"
    return config.is_file() and "kv_lora_rank" in json.loads(config.read_text())


def _counters(metrics: list[Any]) -> tuple[int, list[int]]:
    rounds, per_position = 0, []
    for metric in metrics:
        if metric.name == "vllm:spec_decode_num_drafts":
            rounds = int(metric.value)
        elif metric.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            per_position = [int(v) for v in metric.values]
    return rounds, per_position


def _per_request(output: Any) -> dict[str, list[int]]:
    metrics = getattr(output.outputs[0], "spec_decode_metrics", None)
    if metrics is None:
        # A request that never reached a verify round (e.g. max_new_tokens = 1) reports nothing.
        return {"accepted": [], "drafted": []}
    return {"accepted": list(metrics.per_step_accepted), "drafted": list(metrics.per_step_drafted)}


def _progress_bar(enabled: bool) -> Any:
    """vLLM's prompt progress bar on stdout: the caller shows stdout, and keeps stderr (vLLM's log) for errors."""
    if not enabled:
        return False
    from functools import partial

    from tqdm import tqdm

    return partial(tqdm, file=sys.stdout)


def run(request: dict[str, Any]) -> dict[str, Any]:
    missing = [key for key in REQUIRED if key not in request]
    if missing:
        raise ValueError(f"the request lacks {missing}; it needs {list(REQUIRED)}")
    if request.get("draft") is not None and not request.get("method"):
        raise ValueError("a request with a draft needs its vLLM 'method' (eagle3, dflash, ...)")
    import vllm
    from vllm import LLM

    started = time.perf_counter()
    llm = LLM(**_engine_arguments(request))
    loaded = time.perf_counter()
    outputs = llm.generate(
        _token_prompts(request),
        _call_parameters(request),  # greedy: a request has no temperature
        use_tqdm=_progress_bar(bool(request.get("progress", False))),
    )
    generated = time.perf_counter()
    rounds, per_position = _counters(llm.get_metrics()) if request.get("draft") else (0, [])
    return {
        "vllm_version": vllm.__version__,
        "generations": [list(o.outputs[0].token_ids) for o in outputs],
        "rounds": rounds,
        "accepted_per_position": per_position,
        "per_request": [_per_request(o) for o in outputs] if request.get("draft") else [],
        "seconds": {"engine_start": loaded - started, "generate": generated - loaded},
    }


def _token_prompts(call: dict[str, Any]) -> list[dict[str, list[int]]]:
    return [{"prompt_token_ids": [int(t) for t in ids]} for ids in call["prompts"]]


def _call_parameters(call: dict[str, Any]) -> list[Any]:
    """One ``SamplingParams`` per prompt of a request or a serve call: greedy unless ``temperature`` > 0,
    when each prompt draws from its own seeded generator, so what it generates does not depend on the
    other prompts of the call."""
    from vllm import SamplingParams

    seeds = call.get("seeds") or [None] * len(call["prompts"])
    temperature = float(call.get("temperature", 0.0))
    return [
        SamplingParams(
            temperature=temperature,
            top_p=float(call.get("top_p", 1.0)) if temperature > 0 else 1.0,
            seed=None if temperature == 0 or seed is None else int(seed),
            max_tokens=int(call["max_new_tokens"]),
            ignore_eos=bool(call.get("ignore_eos", False)),
            stop_token_ids=[int(t) for t in call.get("stop_token_ids") or []],
            detokenize=False,
        )
        for seed in seeds
    ]


def serve(engine: dict[str, Any], calls: Any, reply: Any) -> None:
    """Start the engine once, then answer each call line of ``calls`` with one line on ``reply``."""
    from vllm import LLM

    llm = LLM(**_engine_arguments(engine))
    print(json.dumps({"ready": True}), file=reply, flush=True)
    for line in calls:
        if not line.strip():
            continue
        try:
            call = json.loads(line)
            outputs = llm.generate(_token_prompts(call), _call_parameters(call), use_tqdm=False)
            answer: dict[str, Any] = {"generations": [list(o.outputs[0].token_ids) for o in outputs]}
        except Exception as error:  # the caller raises it with the engine's log; the engine stays up
            answer = {"error": f"{type(error).__name__}: {error}"}
        print(json.dumps(answer), file=reply, flush=True)


def main(argv: list[str]) -> int:
    if len(argv) == 3 and argv[0] == "--serve":
        with open(argv[1]) as handle:
            engine = json.load(handle)
        with os.fdopen(int(argv[2]), "w") as reply:
            serve(engine, sys.stdin, reply)
        return 0
    if len(argv) != 2:
        print(
            "usage: python vllm_runner.py REQUEST.json RESULT.json | --serve ENGINE.json REPLY_FD",
            file=sys.stderr,
        )
        return 2
    with open(argv[0]) as handle:
        request = json.load(handle)
    result = run(request)
    with open(argv[1], "w") as handle:
        json.dump(result, handle)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
