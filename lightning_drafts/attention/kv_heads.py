"""Grouped-query attention's key and value heads, repeated out to the query heads for the one kernel that
needs them equal: the dense reference math. PyTorch's CPU flash kernel and flex (``enable_gqa``) do not
(query head ``h`` reads key and value head ``h // groups`` itself, as transformers' ``repeat_kv`` lays them
out), so those paths get the grouped heads and never make the repeated copy, nor sum its gradient back."""

from __future__ import annotations

from torch import Tensor


def query_groups(query: Tensor, key: Tensor) -> int:
    """How many query heads of ``query [B, H, Q, d]`` share each key/value head of ``key [B, H_kv, KV, d]``."""
    heads, kv_heads = query.shape[1], key.shape[1]
    if heads % kv_heads:
        raise ValueError(
            f"{heads} query heads are not a multiple of {kv_heads} key/value heads; grouped-query attention "
            "needs num_attention_heads divisible by num_key_value_heads"
        )
    return heads // kv_heads


def expand_kv_heads(query: Tensor, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
    """``key`` / ``value`` ``[B, H_kv, KV, d]`` with each head repeated ``H / H_kv`` times to the query's ``H``."""
    groups = query_groups(query, key)
    if groups == 1:
        return key, value
    return key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
