"""A GGUF file written out as a plain Hugging Face folder (``config.json``, ``model.safetensors``, the
tokenizer files and chat template), for the engines that load a folder (vLLM, SGLang).

transformers refuses to ``save_pretrained`` a model it loaded from GGUF (it is flagged as quantized), so
the folder's model is built afresh from the loaded config and given the loaded (dequantized) weights."""

from __future__ import annotations

import copy
import os
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from lightning_drafts.gguf.load import load_gguf_model, load_gguf_tokenizer


def convert_gguf(
    path: str | os.PathLike, output_dir: str | os.PathLike, dtype: torch.dtype | None = None
) -> Path:
    """Write the model and tokenizer of the GGUF file ``path`` to ``output_dir`` (created; refused when it
    holds files already) in ``dtype`` (``None``: float32, the dequantized values as they are)."""
    out = Path(output_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"{out} exists and is not an empty directory; choose a new output directory")
    loaded = load_gguf_model(path, dtype=dtype)
    tokenizer = load_gguf_tokenizer(path)
    config = copy.deepcopy(loaded.config)
    # The loaded config says "quantized: gguf, file X"; the folder's weights are plain tensors, and an
    # engine reading that marker would look for a GGUF file (vLLM does).
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=loaded.dtype)
    # strict: every tensor of the fresh model must come from the file (a tied head is one tensor in both).
    model.load_state_dict(loaded.state_dict(), strict=True)
    model.generation_config = loaded.generation_config
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
