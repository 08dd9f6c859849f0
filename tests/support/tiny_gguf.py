"""A tiny GGUF target written in the test, as llama.cpp's converter writes a Llama checkpoint: a random
tied Llama (the LM head is the input embedding, as in SmolLM2) with the shipped byte-level BPE tokenizer
and ChatML template, F32 tensors, and the same model saved as a Hugging Face folder beside it, which a
GGUF load must reproduce exactly.

Tensor names and metadata keys are the ``gguf`` package's own constants (``gguf.MODEL_TENSORS`` /
``gguf.TENSOR_NAMES`` and ``gguf.Keys``), so they are what llama.cpp and transformers' GGUF reader use."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from lightning_drafts.shipped import shipped_target_path

SHIPPED = shipped_target_path("tiny-llama")
# SmolLM2-135M's depth and head layout (30 layers, 9 query / 3 kv heads, tied) at a 144-wide hidden state
# and the shipped tokenizer's 2,048 ids, so configs/real run on it unchanged; the q / k row permutation
# llama.cpp applies (and the reader undoes) moves rows between the halves of every head.
TINY_GGUF_TARGET = {
    "model_type": "llama",
    "vocab_size": 2048,
    "hidden_size": 144,
    "intermediate_size": 256,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": True,
    "pad_token_id": 0,
    "bos_token_id": None,
    "eos_token_id": 2,
}
# token_type values of llama.cpp's vocabulary: a normal token, and a special (control) token.
NORMAL, CONTROL = 1, 3


def tiny_tied_llama(seed: int = 0) -> PreTrainedModel:
    """The random tied Llama the GGUF file holds (seeded)."""
    config = AutoConfig.for_model(**TINY_GGUF_TARGET)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def llama_cpp_permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's q / k row order (its converter's ``LlamaModel.permute``): each head's rotary halves
    interleaved, which transformers' Llama tensor processor undoes on load."""
    return (
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def write_tiny_gguf(directory: Path, seed: int = 0) -> tuple[Path, Path]:
    """``(tiny.gguf, hf folder)`` of one random tied Llama (``seed``) under ``directory``."""
    model = tiny_tied_llama(seed)
    folder = directory / "hf"
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(SHIPPED).save_pretrained(folder)
    path = directory / "tiny.gguf"
    write_gguf(model, path)
    return path, folder


def write_gguf(model: PreTrainedModel, path: Path) -> None:
    config = model.config
    arch = "llama"
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name("tiny-llama-tied")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    _add_tokenizer(writer)
    for name, tensor in _gguf_tensors(model).items():
        writer.add_tensor(name, tensor)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _gguf_tensors(model: PreTrainedModel) -> dict[str, np.ndarray]:
    """The GGUF name -> F32 array of every tensor, in llama.cpp's layout (no ``output.weight``: tied)."""
    config = model.config
    names = gguf.TENSOR_NAMES
    key = gguf.MODEL_TENSOR
    state = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    tensors = {
        names[key.TOKEN_EMBD] + ".weight": state["model.embed_tokens.weight"],
        names[key.OUTPUT_NORM] + ".weight": state["model.norm.weight"],
    }
    per_layer = {
        key.ATTN_NORM: "input_layernorm",
        key.ATTN_Q: "self_attn.q_proj",
        key.ATTN_K: "self_attn.k_proj",
        key.ATTN_V: "self_attn.v_proj",
        key.ATTN_OUT: "self_attn.o_proj",
        key.FFN_NORM: "post_attention_layernorm",
        key.FFN_GATE: "mlp.gate_proj",
        key.FFN_UP: "mlp.up_proj",
        key.FFN_DOWN: "mlp.down_proj",
    }
    for layer in range(config.num_hidden_layers):
        for tensor_key, hf_name in per_layer.items():
            weights = state[f"model.layers.{layer}.{hf_name}.weight"]
            if tensor_key == key.ATTN_Q:
                weights = llama_cpp_permute(weights, config.num_attention_heads)
            elif tensor_key == key.ATTN_K:
                weights = llama_cpp_permute(weights, config.num_key_value_heads)
            tensors[names[tensor_key].format(bid=layer) + ".weight"] = np.ascontiguousarray(weights)
    return tensors


def _add_tokenizer(writer: gguf.GGUFWriter) -> None:
    """The shipped byte-level BPE as llama.cpp stores a GPT-2 style tokenizer: tokens in id order, their
    types, the merges, the special ids and the chat template."""
    spec = json.loads((SHIPPED / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    assert [vocab[t] for t in tokens] == list(range(len(tokens)))
    special = {added["content"] for added in spec["added_tokens"] if added["special"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([CONTROL if t in special else NORMAL for t in tokens])
    writer.add_token_merges(merges)
    writer.add_eos_token_id(vocab["<|im_end|>"])
    writer.add_pad_token_id(vocab["<|endoftext|>"])
    writer.add_add_bos_token(False)
    writer.add_chat_template((SHIPPED / "chat_template.jinja").read_text())
