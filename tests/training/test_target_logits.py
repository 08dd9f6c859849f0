"""A target's teacher logits are the model's own: the scales and soft-caps a causal-LM forward applies after
its LM head (Cohere, Granite, Gemma 2) are applied to the head's product too, and a target whose forward
transforms them otherwise is refused when it is built."""

from __future__ import annotations

import pytest
import torch

from lightning_drafts.core.batch import validate_batch
from lightning_drafts.training.target import FrozenTarget
from tests.support.builders import packed_row, random_docs
from tests.support.target_matrix import ARCHITECTURES, config

_DENSE = {key: value for key, value in ARCHITECTURES["llama"][1].items() if key != "model_type"}
# Each head transform set far from 1 (a scale) or near the logits' own size (a cap), so that one left out
# moves the logits by most of their size.
HEADS = {
    "gemma2": config("gemma2"),
    "granite": {**_DENSE, "model_type": "granite", "logits_scaling": 0.25},
    "cohere": {**_DENSE, "model_type": "cohere", "logit_scale": 4.0},
}


@pytest.mark.parametrize("architecture", sorted(HEADS))
def test_teacher_logits_equal_the_models_own(architecture):
    target = FrozenTarget(HEADS[architecture], attn_backend="eager")
    document = random_docs([11], seed=2)[0]
    packed = validate_batch(packed_row([document], 11), vocab_size=target.vocab_size)
    last = target(packed).last_hidden_state
    logits = target.logits(last)[0]
    with torch.no_grad():
        expected = target.model(input_ids=document[None], use_cache=False).logits[0]
    head = torch.nn.functional.linear(last[0], target.lm_head.weight)
    assert (head - expected).abs().max() > 0.1 * expected.abs().max(), "the transform must matter here"
    # float32, one reduction of 32 terms per logit and one scale or tanh: well inside 1e-5 of their size.
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max()))
    rows = torch.tensor([5, 0, 17])
    subset = target.logits(last, rows)[0]
    torch.testing.assert_close(subset, logits[:, rows], rtol=1e-6, atol=0.0)


# A forward that multiplies by Granite's divisor (HyperCLOVA X), and a vision-language wrapper that applies
# none of its Granite text model's scaling (LLaVA-NeXT): the head's product with the known transforms is
# not the model's logits.
UNKNOWN = {
    "hyperclovax": {**_DENSE, "model_type": "hyperclovax", "logits_scaling": 4.0},
    "llava_next": {
        "model_type": "llava_next",
        "text_config": {**_DENSE, "model_type": "granite", "logits_scaling": 4.0},
        "vision_config": {
            "model_type": "clip_vision_model",
            "hidden_size": 16,
            "intermediate_size": 32,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "image_size": 28,
            "patch_size": 14,
        },
    },
}


@pytest.mark.parametrize("architecture", sorted(UNKNOWN))
def test_a_target_whose_logits_the_teacher_cannot_reproduce_is_refused(architecture):
    with pytest.raises(ValueError, match="its forward transforms them in a way the teacher does not know"):
        FrozenTarget(UNKNOWN[architecture], attn_backend="eager")
