"""Rotary position embeddings of the EAGLE-3 drafts, with frequencies pinned to fp32.

A bf16 copy of the inverse frequencies dephases RoPE as positions grow
(docs/concepts/eagle3.md#rope-precision), so :class:`FrequencyTable` keeps an fp32 master copy and restores it
after every cast or move. Angles and rotations are computed in fp32 and cast back to the input dtype.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

YARN_RAMP_KEYS = ("factor", "beta_fast", "beta_slow", "original_max_position_embeddings")


class FrequencyTable(nn.Module):
    """Inverse RoPE frequencies that stay fp32 whatever dtype the draft is cast to.

    ``inv_freq`` is a non-persistent buffer (never saved: it is derived from the config), re-filled
    from the fp32 master copy after ``.to(dtype)`` / ``.half()`` / Lightning's ``bf16-true``.
    """

    def __init__(self, inv_freq: Tensor, attention_scaling: float = 1.0) -> None:
        super().__init__()
        master = inv_freq.detach().to(dtype=torch.float32)
        # A draft built on the meta device (shape checks, deferred init) has no values to keep.
        self._master = master if master.is_meta else master.to("cpu").clone()
        self.attention_scaling = float(attention_scaling)
        self.register_buffer("inv_freq", self._master.clone(), persistent=False)

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> FrequencyTable:
        super()._apply(fn, recurse)
        self.inv_freq = self._master.to(device=self.inv_freq.device)
        return self

    def angles(self, positions: Tensor) -> Tensor:
        """``[B, T, dim / 2]`` fp32 rotation angles for integer ``positions`` ``[B, T]``."""
        if self.inv_freq.dtype != torch.float32:
            # FSDP1's mixed precision casts buffers in place (``buffer.data = ...``), past ``_apply``.
            self.inv_freq = self._master.to(device=self.inv_freq.device)
        return positions[..., None].float() * self.inv_freq


def rotate_half_rope(x: Tensor, angles: Tensor, attention_scaling: float = 1.0) -> Tensor:
    """Llama-style RoPE (dims ``i`` and ``i + d/2`` form a pair) on ``x`` ``[B, heads, T, d]``."""
    cos = torch.cat([angles.cos(), angles.cos()], dim=-1)[:, None] * attention_scaling
    sin = torch.cat([angles.sin(), angles.sin()], dim=-1)[:, None] * attention_scaling
    x32 = x.float()
    first, second = x32.chunk(2, dim=-1)
    rotated = torch.cat([-second, first], dim=-1)
    return (x32 * cos + rotated * sin).to(x.dtype)


def interleaved_rope(x: Tensor, angles: Tensor) -> Tensor:
    """DeepSeek RoPE (adjacent dims ``2i, 2i+1`` form one complex number) on ``x`` ``[B, heads, T, d]``."""
    pairs = x.float().unflatten(-1, (-1, 2))
    real, imag = pairs.unbind(-1)
    cos, sin = angles.cos()[:, None], angles.sin()[:, None]
    rotated = torch.stack([real * cos - imag * sin, real * sin + imag * cos], dim=-1)
    return rotated.flatten(-2).to(x.dtype)


def llama_rope_table(text_config: Any) -> FrequencyTable:
    """The target's own RoPE (default, linear, llama3, yarn, ...) from its ``rope_parameters``.

    ``dynamic`` NTK scaling is applied with the table built for the configured context (the draft never
    runs past it in training).
    """
    parameters = _rope_parameters(text_config)
    rope_type = parameters.get("rope_type", "default")
    if rope_type == "default":
        head_dim = getattr(text_config, "head_dim", None) or (
            text_config.hidden_size // text_config.num_attention_heads
        )
        return FrequencyTable(default_inverse_frequencies(head_dim, resolve_rope_theta(text_config)))
    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(
            f"the target's rope_type {rope_type!r} is unknown to transformers' ROPE_INIT_FUNCTIONS "
            f"({sorted(ROPE_INIT_FUNCTIONS)}); the draft must reproduce the target's RoPE exactly"
        )
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](text_config, torch.device("cpu"))
    return FrequencyTable(inv_freq, scaling)


def deepseek_rope_table(
    rope_dim: int, theta: float, max_position_embeddings: int, rope_scaling: dict | None
) -> FrequencyTable:
    """DeepSeek's ``precompute_freqs_cis`` inverse frequencies
    (docs/concepts/eagle3.md#mla-attention-and-rope).

    The YaRN ramp correction applies only when ``rope_scaling`` has ``factor``, ``beta_fast``,
    ``beta_slow`` and ``original_max_position_embeddings`` and the context is longer than the original
    one. No ``mscale`` is applied: the draft learns around it, as in the reference.
    """
    inv_freq = default_inverse_frequencies(rope_dim, theta)
    ramp = yarn_ramp(rope_scaling, max_position_embeddings)
    if ramp is not None:
        inv_freq = _yarn_corrected(inv_freq, rope_dim, theta, **ramp)
    return FrequencyTable(inv_freq)


def yarn_ramp(rope_scaling: dict | None, max_position_embeddings: int) -> dict[str, Any] | None:
    """The settings of the YaRN ramp :func:`deepseek_rope_table` applies (``factor``, ``beta_fast``,
    ``beta_slow``, ``original_max_position_embeddings``), or ``None`` where it rotates with plain RoPE."""
    scaling = rope_scaling or {}
    if any(scaling.get(k) is None for k in YARN_RAMP_KEYS):
        return None
    if max_position_embeddings <= scaling["original_max_position_embeddings"]:
        return None
    return {k: scaling[k] for k in YARN_RAMP_KEYS}


def vllm_deepseek_rope_scaling(rope_scaling: dict | None, max_position_embeddings: int) -> dict | None:
    """The ``rope_scaling`` under which vLLM's DeepSeek attention rotates exactly as :func:`deepseek_rope_table`.

    vLLM applies the YaRN ramp whenever ``rope_scaling`` is set (whatever the context length), multiplies
    cos / sin by ``mscale(mscale) / mscale(mscale_all_dim)`` and the softmax scale by
    ``mscale(mscale_all_dim)²``. The draft applies neither magnitude (it learns around them,
    docs/concepts/eagle3.md#mla-attention-and-rope), so a target's ``mscale: 1`` copied verbatim would sharpen
    every served attention row (about 1.9x for DeepSeek-V3's factor 40). Hence ``null`` where the draft uses
    plain RoPE, else the ramp's settings with ``mscale`` and ``mscale_all_dim`` 0, for which both of vLLM's
    magnitudes are exactly 1.
    """
    ramp = yarn_ramp(rope_scaling, max_position_embeddings)
    if ramp is None:
        return None
    return {"rope_type": "yarn", **ramp, "mscale": 0.0, "mscale_all_dim": 0.0}


def default_inverse_frequencies(dim: int, theta: float) -> Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))


def resolve_rope_theta(text_config: Any) -> float:
    """``rope_parameters["rope_theta"]`` (transformers 5.x), else a top-level ``rope_theta``, else 10000."""
    theta = _rope_parameters(text_config).get("rope_theta")
    if theta is None:
        theta = getattr(text_config, "rope_theta", None)
    return float(theta) if theta is not None else 10000.0


def rope_scaling_of(text_config: Any) -> dict | None:
    """The scaling part of the target's RoPE config, or ``None`` for plain RoPE."""
    parameters = {k: v for k, v in _rope_parameters(text_config).items() if k != "rope_theta"}
    if parameters.get("rope_type", "default") == "default" and len(parameters) <= 1:
        return None
    return parameters


def _rope_parameters(text_config: Any) -> dict:
    for name in ("rope_parameters", "rope_scaling"):
        value = getattr(text_config, name, None)
        if isinstance(value, dict):
            return dict(value)
    return {}


def _yarn_corrected(
    inv_freq: Tensor,
    dim: int,
    theta: float,
    factor: float,
    beta_fast: float,
    beta_slow: float,
    original_max_position_embeddings: int,
) -> Tensor:
    def correction_dim(rotations: float) -> float:
        return (
            dim
            * math.log(original_max_position_embeddings / (rotations * 2 * math.pi))
            / (2 * math.log(theta))
        )

    low = max(math.floor(correction_dim(beta_fast)), 0)
    high = min(math.ceil(correction_dim(beta_slow)), dim - 1)
    if low == high:
        high += 0.001  # a zero-width ramp would divide by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp
    return inv_freq / factor * (1 - keep) + inv_freq * keep
