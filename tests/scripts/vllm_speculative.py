"""Greedy speculative decoding by a real vLLM engine, for the tests that compare it with the built-in decode.

Run with the python of a vLLM environment (never this project's: vLLM pins its own torch), as
``python vllm_speculative.py REQUEST.json RESULT.json``. The request names ``target`` and ``draft``
directories, vLLM's speculative ``method``, ``num_speculative_tokens``, token-id ``prompts`` and
``max_new_tokens``; the result holds each prompt's generated ids and vLLM's speculative-decoding counters
(``num_drafts``: verify rounds, ``accepted_per_position``: rounds that accepted drafted token k).

A stopgap until the shared runner (``lightning_drafts/serving/vllm_runner.py``) lands; swap to it then.
Imports nothing from this project.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

# In-process engine (no engine-core subprocess to spawn from a script without a __main__ guard) and a
# small KV cache: the tests' targets are tiny.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

COUNTERS = {
    "vllm:spec_decode_num_drafts": "num_drafts",
    "vllm:spec_decode_num_draft_tokens": "num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens_per_pos": "accepted_per_position",
}


def main(request_path: Path, result_path: Path) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    request = json.loads(request_path.read_text())
    llm = LLM(
        model=request["target"],
        skip_tokenizer_init=True,  # token-id prompts; the tests' targets ship no tokenizer
        dtype="float32",
        enforce_eager=True,
        max_model_len=request["max_model_len"],
        # One request at a time: batching could reorder floating-point sums and so flip a near-tie.
        max_num_seqs=1,
        disable_log_stats=False,  # the speculative-decoding counters are stats
        speculative_config={
            "method": request["method"],
            "model": request["draft"],
            "num_speculative_tokens": request["num_speculative_tokens"],
        },
    )
    sampling = SamplingParams(
        temperature=0.0, max_tokens=request["max_new_tokens"], ignore_eos=True, detokenize=False
    )
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in request["prompts"]], sampling)
    result = {"generations": [list(output.outputs[0].token_ids) for output in outputs]}
    for metric in llm.get_metrics():
        if metric.name in COUNTERS:
            value = getattr(metric, "values", None)
            result[COUNTERS[metric.name]] = list(value) if value is not None else metric.value
    result_path.write_text(json.dumps(result))


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
