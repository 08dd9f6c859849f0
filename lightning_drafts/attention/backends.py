"""Document-isolating attention: mask builders and the kernel choice shared by target and drafts.

Three ways to keep packed documents apart, all derived from the per-token document ids of
:class:`~lightning_drafts.core.batch.PackedBatch`:

* ``sdpa`` (and ``eager``): a dense boolean block-causal mask ``[B, 1, T, T]`` (the CPU path); drafts
  cut it into a :class:`~lightning_drafts.attention.tiled.TiledMask` so their attention skips the keys
  no query sees (``eager`` keeps the plain dense math as a reference), and the frozen target's ``sdpa``
  on the CPU builds no mask at all: it gathers the real tokens into one row and attends within each
  document's span, causal
  (:mod:`lightning_drafts.training.document_target_attention`);
* ``flex``: a sparse flex-attention ``BlockMask`` built from a ``mask_mod`` (the GPU path; mask creation
  and the kernel are compiled once, lazily, on CUDA only, through entry points of their own
  (:func:`compiled_flex_attention`): compiling costs seconds and CPU flex has no backward, so the CPU
  keeps the eager functions);
* ``flash``: FlashAttention varlen over the real tokens of the micro-batch flattened into one
  sequence (GPU with flash-attn installed; imported lazily, never at module import).

A requested kernel that is not available raises; nothing silently falls back.
"""

from __future__ import annotations

import functools
import importlib.util
import types
import warnings
from collections.abc import Callable, Hashable
from typing import Any

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import AuxRequest, create_block_mask, flex_attention

from lightning_drafts.attention.kv_heads import expand_kv_heads, query_groups
from lightning_drafts.attention.tiled import TiledMask, tiled_attention

BACKENDS = ("sdpa", "eager", "flex", "flash")
MaskMod = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]


@functools.cache
def flash_attn_problem() -> str | None:
    """Why flash-attn cannot run in this process, or None when it can. Its varlen function is imported (once,
    on the first call, never at module import): that loads the compiled extension, and a wheel built for
    another torch or CUDA fails there (an undefined symbol), not at ``find_spec``."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    if importlib.util.find_spec("flash_attn") is None:
        return "flash-attn is not installed"
    try:
        from flash_attn import flash_attn_varlen_func  # noqa: F401
    except Exception as error:  # ImportError / OSError of the extension, or anything its import raises
        return (
            f"flash-attn is installed but does not load with torch {torch.__version__} (CUDA "
            f"{torch.version.cuda}): {type(error).__name__}: {error}; build it against this torch "
            "(pip install flash-attn --no-build-isolation) or install a wheel made for it"
        )
    return None


def flash_attn_available() -> bool:
    """flash-attn loads and a CUDA device exists (:func:`flash_attn_problem` says why not)."""
    return flash_attn_problem() is None


def resolve_backend(requested: str, device: torch.device | str) -> str:
    """Turn ``"auto"`` into the fastest kernel for ``device``; refuse an unavailable explicit request."""
    device = torch.device(device)
    on_cuda = device.type == "cuda"
    if requested == "auto":
        if not on_cuda:
            return "sdpa"
        problem = flash_attn_problem()
        if problem is None:
            return "flash"
        if importlib.util.find_spec("flash_attn") is not None:
            # Installed but unusable: say so once rather than pass it over in silence.
            warnings.warn(f"attention backend auto: not flash-attn ({problem}); using flex", stacklevel=2)
        return "flex"
    if requested not in BACKENDS:
        raise ValueError(f"attention backend {requested!r} is unknown; choose one of {('auto', *BACKENDS)}")
    if requested == "flash" and not (on_cuda and flash_attn_available()):
        problem = flash_attn_problem() if on_cuda else f"the device is {device}"
        raise ValueError(
            f"attention backend 'flash' needs flash-attn on a CUDA device, but {problem}; install it on a GPU "
            "machine (docs/guides/gpu.md) or choose 'sdpa' / 'flex'"
        )
    return requested


def block_causal_mask(doc_ids: Tensor) -> Tensor:
    """Boolean ``[B, 1, T, T]`` mask, True where query i may attend key j (same document, j <= i).

    Pad slots belong to the row's last document: real tokens never see them (they come later), and
    pad queries see at least themselves, so no query row is ever fully masked.
    """
    same_doc = doc_ids[:, :, None] == doc_ids[:, None, :]
    causal = torch.ones(doc_ids.shape[1], doc_ids.shape[1], dtype=torch.bool, device=doc_ids.device).tril()
    return (same_doc & causal)[:, None]


def additive_mask(mask: Tensor, dtype: torch.dtype) -> Tensor:
    """The ``eager`` form of a boolean mask: 0 where allowed, the dtype's minimum elsewhere."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)


def document_causal_mask_mod(doc_ids: Tensor) -> MaskMod:
    """The flex ``mask_mod`` of :func:`block_causal_mask`."""

    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return (doc_ids[b, q_idx] == doc_ids[b, kv_idx]) & (kv_idx <= q_idx)

    return mask_mod


def block_mask_from_mask_mod(mask_mod: MaskMod, batch: int, q_len: int, kv_len: int, device: torch.device):
    """A sparse flex ``BlockMask`` (built once per batch, shared by every layer and step)."""
    # Eager creation evaluates the mask_mod densely over Q x KV; compiled, it never materialises it.
    if compiles_on(device):
        create = compiled_create_block_mask(mask_kind(mask_mod))
    else:
        create = _create_block_mask
    # A mask is integers: built without grad whoever asks (the target under no_grad, a draft under grad), so
    # grad mode is never one more compiled variant.
    with torch.no_grad():
        return create(mask_mod, batch, q_len, kv_len, device)


def mask_for_queries(mask: Tensor | TiledMask | object, queries: Tensor) -> Tensor | TiledMask | object:
    """``mask`` (any of the three forms) restricted to the query rows ``queries`` (long, ascending,
    distinct), in that order: attention under it gives exactly those queries' outputs under ``mask``."""
    if isinstance(mask, TiledMask):
        return mask.select_queries(queries)
    if isinstance(mask, Tensor):
        return mask.index_select(2, queries)
    if queries.numel() == 0:
        raise ValueError("mask_for_queries needs at least one query; run no attention for none")
    inner = mask.mask_mod

    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        # Flex pads the queries to whole blocks; a padded index reads the last query and is masked off. The
        # count is read from the tensor, so a compiled mask creation sees a size, not a new constant per call.
        count = queries.shape[0]
        return (q_idx < count) & inner(b, h, queries[q_idx.clamp(max=count - 1)], kv_idx)

    # A tensor of its own, not a view: dynamo guards a captured view's storage offset (a recompile per step).
    queries = queries.clone()
    batch, _, _, kv_len = mask.shape
    return block_mask_from_mask_mod(mask_mod, batch, int(queries.numel()), kv_len, queries.device)


def dense_mask_from_mask_mod(
    mask_mod: MaskMod, batch: int, q_len: int, kv_len: int, device: torch.device
) -> Tensor:
    """Materialise a ``mask_mod`` as a boolean ``[B, 1, Q, KV]`` tensor (used to prove masks equal)."""
    from torch.nn.attention.flex_attention import create_mask

    return create_mask(mask_mod, batch, 1, q_len, kv_len, device=device)


def attention_with_lse(
    query: Tensor, key: Tensor, value: Tensor, mask: Tensor | TiledMask | object, scale: float
) -> tuple[Tensor, Tensor]:
    """Masked attention that also returns the fp32 log-sum-exp of the scores per query.

    ``mask`` is a boolean ``[B, 1|H, Q, KV]`` tensor (computed densely, softmax in fp32: the reference),
    a :class:`~lightning_drafts.attention.tiled.TiledMask` (the fast CPU path) or a flex ``BlockMask``
    (GPU). Drafts that add extra key columns outside the mask (EAGLE-3's TTT diagonal) merge them
    through the returned log-sum-exp, so it carries gradients. A query with no visible key returns
    zeros and ``-inf``, never NaN. ``key`` / ``value`` may have fewer heads than ``query``, a divisor of
    them (grouped-query attention, :mod:`~lightning_drafts.attention.kv_heads`).
    """
    query, key, value = one_dtype(query, key, value)
    if isinstance(mask, TiledMask):
        out, lse = tiled_attention(query, key, value, mask, scale, with_lse=True)
        return out, lse
    if isinstance(mask, Tensor):
        key, value = expand_kv_heads(query, key, value)
        scores = torch.matmul(query.float(), key.float().transpose(-1, -2)) * scale
        scores = scores.masked_fill(~mask, float("-inf"))
        lse = torch.logsumexp(scores, dim=-1)
        probs = torch.exp(scores - lse.unsqueeze(-1).clamp(min=torch.finfo(torch.float32).min))
        probs = probs.nan_to_num(0.0)
        return torch.matmul(probs.to(value.dtype), value), lse
    flex = flex_attention_for(query.device, with_lse=True, kind=mask_kind(mask.mask_mod))
    return _flex_with_lse(flex, query, key, value, mask, scale)


def masked_attention(
    query: Tensor, key: Tensor, value: Tensor, mask: Tensor | TiledMask | object, scale: float
) -> Tensor:
    """:func:`attention_with_lse` without the log-sum-exp, for callers that merge nothing into it:
    the tiled and flex paths then skip the work the log-sum-exp's gradient needs."""
    query, key, value = one_dtype(query, key, value)
    if isinstance(mask, TiledMask):
        return tiled_attention(query, key, value, mask, scale, with_lse=False)[0]
    if isinstance(mask, Tensor):
        return attention_with_lse(query, key, value, mask, scale)[0]
    flex = flex_attention_for(query.device, kind=mask_kind(mask.mask_mod))
    return flex(query, key, value, mask, scale, query_groups(query, key) > 1)


def one_dtype(*tensors: Tensor) -> tuple[Tensor, ...]:
    """``tensors`` in one dtype, as the attention kernels (flex, the CPU flash kernel) require: under
    autocast its lower-precision dtype (what SDPA computes in there), else their promoted dtype. Under
    ``bf16-mixed`` a projection's output is bf16 but a float32-weight RMSNorm after it returns float32
    (queries and keys), while the values come straight from their bf16 projection."""
    device_type = tensors[0].device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
    else:
        dtype = functools.reduce(torch.promote_types, (t.dtype for t in tensors))
    return tuple(t.to(dtype) for t in tensors)


def flex_attention_for(
    device: torch.device, with_lse: bool = False, kind: Hashable = None
) -> Callable[..., Any]:
    """The drafts' flex attention ``(query, key, value, block_mask, scale) -> out`` (``(out, lse)`` with
    ``with_lse``): on CUDA compiled once per process and mask ``kind`` (:func:`mask_kind` of the block
    mask's ``mask_mod``; eager flex is a slow reference there), the eager function elsewhere (CPU flex has
    no backward)."""
    if compiles_on(device):
        return compiled_flex_attention(with_lse, kind)
    return _flex_lse if with_lse else _flex


def _flex_with_lse(
    flex: Callable[..., Any], query: Tensor, key: Tensor, value: Tensor, mask: object, scale: float
) -> tuple[Tensor, Tensor]:
    out, lse = flex(query, key, value, mask, scale, query_groups(query, key) > 1)
    return out, lse.float()


# Grouped key/value heads go to flex as they are (``enable_gqa``): repeating them out to the query heads
# first would copy keys and values (and sum their gradients back) for every group.
def _flex(
    query: Tensor, key: Tensor, value: Tensor, block_mask: object, scale: float, enable_gqa: bool = False
) -> Tensor:
    return flex_attention(query, key, value, block_mask=block_mask, scale=scale, enable_gqa=enable_gqa)


def _flex_lse(
    query: Tensor, key: Tensor, value: Tensor, block_mask: object, scale: float, enable_gqa: bool = False
) -> tuple[Tensor, Tensor]:
    out, aux = flex_attention(
        query,
        key,
        value,
        block_mask=block_mask,
        scale=scale,
        enable_gqa=enable_gqa,
        return_aux=AuxRequest(lse=True),
    )
    return out, aux.lse


def _create_block_mask(mask_mod: MaskMod, batch: int, q_len: int, kv_len: int, device: torch.device):
    return create_block_mask(mask_mod, B=batch, H=None, Q_LEN=q_len, KV_LEN=kv_len, device=device)


# Dynamo keeps one cache per code object and stops compiling a function after
# `torch._dynamo.config.recompile_limit` (8) variants, running it unfused (flex: the full score matrix) from
# then on, silently. Every mask kind (its mask_mod's code) is a guard of its own, and so are grad mode, a
# captured None, batch sizes 0 / 1 and, for flex, autocast: one code object shared by every kind of the
# target and of every draft passed 8 within one train + validation cycle. So each mask kind gets entry points
# of its own (a copy of the function with its own code object, hence its own cache and limit), compiled with
# symbolic sizes from the first call, and mask creation runs without grad. transformers compiles
# `flex_attention` itself for the target's layers, a cache apart from all of these.
ENTRY_POINTS: dict[str, Callable[..., Any]] = {}
# The compiler of every entry point (a test counts variants on a CPU with dynamo's CompileCounter instead).
COMPILER: Any = "inductor"


def compiles_on(device: torch.device | str) -> bool:
    """Whether the drafts' flex attention and every flex mask creation are compiled on ``device``: on CUDA
    only (CPU flex has no backward, and compiling costs seconds there)."""
    return torch.device(device).type == "cuda"


def mask_kind(mask_mod: MaskMod) -> Hashable:
    """What makes two ``mask_mod`` s different compiled programs: the function's code and, for what it
    closes over, the kind of every mask it wraps (:func:`mask_for_queries`) and which values are None (the
    block mask's optional window). Tensors and sizes are inputs, not kinds."""
    closed_over = []
    for cell in mask_mod.__closure__ or ():
        value = cell.cell_contents
        closed_over.append(mask_kind(value) if hasattr(value, "__code__") else value is None)
    return mask_mod.__code__, tuple(closed_over)


def _own_entry(function: Callable[..., Any], kind: Hashable) -> Callable[..., Any]:
    """``function`` with a code object of its own for ``kind``: dynamo's cache and recompile limit apart."""
    name = f"{function.__name__}_kind{len(ENTRY_POINTS)}"
    code = function.__code__.replace(co_name=name)
    entry = types.FunctionType(code, function.__globals__, name, function.__defaults__, function.__closure__)
    ENTRY_POINTS[name] = entry
    return entry


@functools.cache
def compiled_flex_attention(with_lse: bool = False, kind: Hashable = None) -> Callable[..., Any]:
    """The compiled draft entry point (:func:`_flex` or :func:`_flex_lse`) of one mask ``kind``, created once
    per process. Shapes change every batch (block drafts: M * block_size queries; EAGLE-3: the live slots):
    sizes are symbolic from the first call."""
    return torch.compile(_own_entry(_flex_lse if with_lse else _flex, kind), dynamic=True, backend=COMPILER)


@functools.cache
def compiled_create_block_mask(kind: Hashable = None) -> Callable[..., Any]:
    """The compiled ``create_block_mask`` of one mask ``kind`` (``create_block_mask(_compile=True)`` is
    deprecated: a fresh compile wrapper per call), created once per process, symbolic sizes."""
    return torch.compile(_own_entry(_create_block_mask, kind), dynamic=True, backend=COMPILER)


def reset_compiled_entries() -> None:
    """Forget every compiled entry point and dynamo's caches (a fresh process's state)."""
    torch._dynamo.reset()
    compiled_flex_attention.cache_clear()
    compiled_create_block_mask.cache_clear()
    ENTRY_POINTS.clear()


def compiled_variants() -> dict[str, int]:
    """Compiled variants held by each compiled attention entry point of this process (dynamo's cache entries
    of its code object), for the fit's log: one that reaches ``recompile_limit`` runs eager from then on."""
    from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list

    return {name: len(_debug_get_cache_entry_list(entry.__code__)) for name, entry in ENTRY_POINTS.items()}


def flash_varlen_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    cu_seqlens: Tensor,
    max_seqlen: int,
    scale: float,
    causal: bool = True,
) -> Tensor:
    """FlashAttention over documents laid end to end: ``[total, heads, dim]`` in, same layout out."""
    if not flash_attn_available():
        raise ValueError(
            "flash_varlen_attention needs flash-attn on a CUDA device; install the 'flash' extra"
        )
    from flash_attn import flash_attn_varlen_func

    return flash_attn_varlen_func(
        query,
        key,
        value,
        cu_seqlens_q=cu_seqlens,
        cu_seqlens_k=cu_seqlens,
        max_seqlen_q=max_seqlen,
        max_seqlen_k=max_seqlen,
        softmax_scale=scale,
        causal=causal,
    )
