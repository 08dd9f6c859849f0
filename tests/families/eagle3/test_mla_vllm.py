"""MLA-EAGLE-3 served by a real vLLM engine: the export loads as vLLM's ``Eagle3DeepseekV2ForCausalLM`` beside
a DeepSeek-V3 (MLA + MoE, YaRN) target, and vLLM's greedy speculative decoding equals ``evaluate_export``'s
token for token, round for round and accepted token for accepted token.

vLLM runs in its own environment through the project's runner (``evaluate_export(..., engine="vllm")``; the
environment from :mod:`tests.support.vllm_subprocess`). The export read by vLLM's model code without serving:
``tests/families/test_vllm_layouts.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_drafts.serving.report import EvaluationReport
from lightning_drafts.workflows.evaluate import evaluate_export
from tests.families.eagle3.vllm_cases import STEPS, mla_module, save_target
from tests.support.vllm_subprocess import vllm_python

PROMPTS = [
    [5, 17, 33, 101, 7],
    [9, 200, 13, 44, 45, 46, 90],
    [3, 3, 80, 81],
    [250, 12, 6, 77, 78, 79, 30, 31],
]
MAX_NEW_TOKENS = 48

pytestmark = pytest.mark.usefixtures("one_thread")


def evaluate(export: Path, **engine) -> EvaluationReport:
    return evaluate_export(
        export,
        PROMPTS,
        max_new_tokens=MAX_NEW_TOKENS,
        num_steps=STEPS,
        stop_token_ids=[],
        with_training_estimate=False,
        check_lossless=True,
        **engine,
    )


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> tuple[Path, EvaluationReport, EvaluationReport]:
    root = tmp_path_factory.mktemp("mla_vllm")
    export = mla_module(save_target(root / "target")).export(root / "draft")
    return root, evaluate(export), evaluate(export, engine="vllm", vllm_python=vllm_python())


def test_vllm_generates_the_built_in_decodes_tokens(served):
    _, ours, vllm = served
    assert ours.lossless is True and vllm.lossless is True
    assert vllm.generations == ours.generations


def test_vllm_verifies_the_same_rounds_and_accepts_the_same_tokens_per_position(served):
    _, ours, vllm = served
    assert vllm.rounds == vllm.engine_info["rounds"] == ours.rounds
    assert vllm.engine_info["draft_tokens"] == STEPS * ours.rounds
    assert vllm.served.hits == vllm.engine_info["accepted_per_position"] == ours.served.hits
    # Neither all nor nothing accepted, at every depth: the counts test the draft, not a degenerate case.
    assert 0 < ours.served.hits[-1] <= ours.served.hits[0] < ours.rounds


def test_the_counts_hang_on_the_attention(served):
    """The same draft without its attention branch accepts differently: agreeing with vLLM above needed
    vLLM's MLA attention (latents, rope pairs, YaRN, softmax scale) to compute what the draft computes."""
    root, ours, _ = served
    without_attention = mla_module(root / "target", attention_scale=0.0).export(root / "without_attention")
    assert evaluate(without_attention).served.hits != ours.served.hits
