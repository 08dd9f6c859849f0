"""Tiny trained targets that ship with the package, so a quickstart learns something visible offline.

Three Hugging Face model directories (``config.json``, ``model.safetensors``, tokenizer files with a
ChatML template) that transformers and vLLM both load from disk, all sharing one 2,048-id byte-level BPE
tokenizer trained on the embedded chitchat corpus:

* ``tiny-llama``: Llama, for EAGLE-3;
* ``tiny-qwen3``: Qwen3, for DFlash, DFlash2 and DSpark;
* ``tiny-deepseek-v3``: DeepSeek-V3 (MLA + MoE), for MLA-EAGLE-3. Its latent sizes (``kv_lora_rank``
  512, ``qk_rope_head_dim`` 64) are the only ones vLLM's CPU MLA kernel runs.

A config names one as ``shipped:<name>`` wherever a hub id or path is accepted (``model.target``,
``data.tokenizer``, ``evaluate --target``). ``tools/make_shipped_targets.py`` remakes them.
"""

from __future__ import annotations

import re
from importlib import resources
from pathlib import Path

SHIPPED_PREFIX = "shipped:"
SHIPPED_TARGETS = ("tiny-llama", "tiny-qwen3", "tiny-deepseek-v3")
# The special tokens of the shared tokenizer, in id order (ids 0..3).
PAD_TOKEN = "<|endoftext|>"
MASK_TOKEN = "<|mask|>"
SPECIAL_TOKENS = (PAD_TOKEN, "<|im_start|>", "<|im_end|>", MASK_TOKEN)
# Never emitted by the tokenizer for text, so block drafts can use it as their mask token.
MASK_TOKEN_ID = SPECIAL_TOKENS.index(MASK_TOKEN)


def shipped_target_path(name: str) -> Path:
    """The directory of a shipped target, e.g. ``shipped_target_path("tiny-llama")``."""
    if name not in SHIPPED_TARGETS:
        raise ValueError(f"no shipped target named {name!r}; the package ships {list(SHIPPED_TARGETS)}")
    path = Path(str(resources.files(__name__).joinpath(name)))
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"shipped target {name!r} is missing its files at {path}; reinstall lightning-drafts or remake "
            "them with `python tools/make_shipped_targets.py`"
        )
    return path


# What the hub accepts as a repository id: ``name`` or ``namespace/name``.
HUB_ID = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*(/[A-Za-z0-9_][A-Za-z0-9_.-]*)?")


def resolve_shipped(spec: str) -> str:
    """``shipped:<name>`` becomes that target's local directory; a local path or a hub id is returned
    unchanged. A string that is neither an existing path nor a hub id is refused as a missing directory
    (transformers would call it a malformed repository id)."""
    if spec.startswith(SHIPPED_PREFIX):
        return str(shipped_target_path(spec[len(SHIPPED_PREFIX) :]))
    if not Path(spec).expanduser().exists() and HUB_ID.fullmatch(spec) is None:
        raise FileNotFoundError(
            f"no such directory: {spec} (a target or tokenizer is a local model directory, a hub id such as "
            f"Qwen/Qwen3-8B, or shipped:<name> with a name of {list(SHIPPED_TARGETS)})"
        )
    return spec
