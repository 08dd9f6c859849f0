"""The DeepSeek-V3 target and MLA-EAGLE-3 draft that vLLM's CPU build can serve, shared by the vLLM tests.

vLLM's CPU MLA kernel takes only a 576-wide latent (``kv_lora_rank`` 512 + ``qk_rope_head_dim`` 64); the rest
is tiny. YaRN past a short original context, so the ramp and vLLM's mscale handling are exercised;
``noaux_tc`` routing with sigmoid scores is what HF's DeepSeek-V3 computes (vLLM reads it from
``topk_method`` / ``scoring_func``, and without them builds a different router).
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from lightning_drafts import MLAEagle3Module
from tests.families.eagle3.cases import imitate_target

STEPS = 3
VOCAB = 256
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
# Residual branches this strong overturn some of the read-out's choices: acceptance then hangs on the MLA
# attention and MLP math, which vLLM must reproduce for the counts to agree.
BRANCH_SCALE = 0.01


def save_target(directory: Path) -> Path:
    """The seeded random target, its LM head scaled so greedy choices are far from ties, saved as HF does."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**TARGET))
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(10)
    model.save_pretrained(directory)
    return directory


def mla_module(target_dir: Path, attention_scale: float = BRANCH_SCALE) -> MLAEagle3Module:
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
