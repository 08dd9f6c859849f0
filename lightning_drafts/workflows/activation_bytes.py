"""Bytes of one micro-batch's training activations, per draft family, counted from the tensors the code keeps.

Each function counts what is alive at the step's peak, which for every family is the end of the forward
pass (the vocabulary terms' own backward already ran, chunk by chunk, inside it): what autograd saved for
backward, plus the largest transient of the forward's last phase. The derivation, tensor by tensor, is
docs/guides/memory-plan.md; the names of the terms below are the ones that page uses.

``e`` is the bytes of an activation a matmul writes (2 under ``bf16-mixed``'s autocast, 4 in float32);
the RMS norms, rotary tables, residual stream, softmaxes and log-softmaxes are float32 whatever the
precision (``f`` = 4 below).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

F32 = 4
# Queries per tile of the CPU attention kernel (lightning_drafts.attention.tiled.TILE_QUERIES): each tile
# gathers the key columns its queries see; flex on CUDA reads keys in place.
CPU_TILE_QUERIES = 256


@dataclass(frozen=True)
class Shapes:
    """The widths the activation terms multiply: the draft's own and the data's."""

    hidden: int
    intermediate: int
    query_width: int  # heads x head dim
    kv_width: int  # key-value heads x head dim
    vocab: int  # the vocabulary the draft's logits span (EAGLE-3: the draft vocabulary)
    target_vocab: int
    captured: int  # target layers the draft reads
    draft_layers: int


@dataclass(frozen=True)
class Workload:
    """One micro-batch: ``rows`` rows of ``width`` tokens, documents of ``document_tokens`` (the last quarter
    of the estimate's assumptions), ``supervised`` of each document's tokens in the loss, and ``coverage``:
    the share of supervised tokens whose label is in the draft vocabulary (EAGLE-3's live slots)."""

    rows: int
    width: int
    document_tokens: int
    supervised: float
    coverage: float = 1.0

    @property
    def tokens(self) -> int:
        return self.rows * self.width

    @property
    def documents(self) -> float:
        return self.tokens / self.document_tokens


@dataclass(frozen=True)
class BlockSettings:
    block_size: int
    anchors_per_document: int
    partial_blocks: bool  # DSpark: an anchor needs only the next token in its document
    logits_chunk_blocks: int | None
    conv_convolutions: int = 0  # DFlash2: two in-block convolutions per layer
    markov_rank: int = 0  # DSpark's Markov head
    differentiable_outputs: int = 1  # over_chunks outputs with their own stored gradients


def block_count(work: Workload, settings: BlockSettings) -> float:
    """Blocks of a micro-batch: ``min(anchors, candidates)`` per document (attention/anchors.py), where a
    candidate is a supervised token whose block (DSpark: whose next token) stays in its document."""
    reach = 1 if settings.partial_blocks else settings.block_size - 1
    candidates = max(work.supervised * work.document_tokens - reach, 0.0)
    return work.documents * min(settings.anchors_per_document, candidates)


def cpu_gathered_keys(queries: float, work: Workload) -> float:
    """Key columns the CPU tile kernel gathers: per tile of queries, the context of the document(s) its
    queries see plus the tile's own keys."""
    tiles = math.ceil(queries / CPU_TILE_QUERIES) + work.documents
    return tiles * (work.document_tokens + CPU_TILE_QUERIES)


def block_draft_bytes(
    shapes: Shapes, work: Workload, settings: BlockSettings, e: int, cpu: bool, checkpointing: bool = False
) -> dict[str, float]:
    """DFlash / DFlash2 / DSpark (lightning_drafts/blockdraft/draft.py and the family modules)."""
    h, i, qd, kd = shapes.hidden, shapes.intermediate, shapes.query_width, shapes.kv_width
    blocks = block_count(work, settings)
    # DSpark's slot k predicts the token after it (every slot a chain position); DFlash's slot 0 is the anchor.
    chains = settings.block_size if settings.partial_blocks else settings.block_size - 1
    slots = blocks * settings.block_size
    # The last layer's queries and MLP rows (_needed_slots); DFlash2's convolutions reach back to every slot.
    needed = slots if settings.conv_convolutions else blocks * chains
    context = work.tokens
    keys = context + slots
    layers = shapes.draft_layers
    # Per query slot and layer: two RMS norms (input and output kept, f32), two residual sums (f32).
    norms = 6 * h * F32
    # q_proj out, its q_norm (f32 inside), the rotated and transposed copies, the attention output.
    query = qd * (4 * e + F32)
    mlp = 4 * i * e  # gate, up, SiLU(gate), their product
    # Per key (context + every slot) and layer: the concatenated keys' input (f32), k_proj and v_proj out,
    # k_norm (f32), the rotated key.
    key = h * F32 + kd * (3 * e + F32)
    gathered = 2 * cpu_gathered_keys(slots, work) * kd * e if cpu else 0.0
    # DFlash2, per convolution: its padded input (H) and the taps' grouped sums (2 x 2H), and one more norm.
    conv = (settings.conv_convolutions * 6 * h + h) * F32 if settings.conv_convolutions else 0
    per_layer = slots * (norms + conv) + keys * key + gathered
    full_layer = per_layer + slots * (query + mlp)
    last_layer = per_layer + needed * (query + mlp)
    if checkpointing:
        # Each layer keeps only its input ([slots, H] f32; the fused context is kept once, below); backward
        # rebuilds one layer at a time.
        layer_terms = {
            "draft layer inputs (checkpointed)": layers * slots * h * F32,
            "one draft layer rebuilt in backward": full_layer if layers > 1 else last_layer,
        }
    else:
        layer_terms = {
            "draft layers (all but the last)": (layers - 1) * full_layer,
            "last draft layer": last_layer,
        }
    terms = {
        **layer_terms,
        # Captured features (concatenated, then gathered per context key), fc output and its hidden_norm (f32).
        "fused target features": context * (2 * shapes.captured * h * e + h * e + 2 * h * F32),
        # Block embeddings (f32), the final norm, the last layer's spread rows, the chain states and one
        # stored gradient of them per differentiable output (over_chunks; DFlash2's selector is a second).
        "block inputs, final norm, chain states": slots * 5 * h * F32
        + blocks * chains * (1 + settings.differentiable_outputs) * h * F32,
    }
    if settings.markov_rank:
        # DSpark: the Markov head's rank-r factors and the confidence head's input, per chain position.
        terms["Markov and confidence heads"] = needed * (2 * settings.markov_rank + h) * F32
    chunk = blocks if settings.logits_chunk_blocks is None else min(blocks, settings.logits_chunk_blocks)
    # One chunk's logits (e), their f32 log-softmax and its gradient: freed before the next chunk.
    terms["logits chunk"] = chunk * chains * shapes.target_vocab * (e + 2 * F32)
    return terms


def eagle3_bytes(
    shapes: Shapes, work: Workload, ttt_length: int, e: int, cpu: bool, mla: MLAWidths | None = None
) -> dict[str, float]:
    """EAGLE-3 and MLA-EAGLE-3 (lightning_drafts/eagle3/ttt.py, live_slots.py, step_objective.py): one
    decoder layer run ``ttt_length`` times at the live slots of each step."""
    h, i, vd = shapes.hidden, shapes.intermediate, shapes.vocab
    tokens = work.tokens
    supervised = tokens * work.supervised
    # Step k's supervised slots: a label in the draft vocabulary; its live slots: supervised at k or later.
    per_step = supervised * work.coverage
    live = [supervised * (1 - (1 - work.coverage) ** (ttt_length - k)) for k in range(ttt_length)]
    if mla is None:
        query = shapes.query_width * (3 * e + F32)  # q_proj out, rotated (f32 tables), transposed copy
        key = shapes.kv_width * (4 * e + F32)  # k, v, rotated k, their transposed copies
        attention_out = shapes.query_width * e
    else:
        query = mla.query_bytes(e)
        key = mla.key_bytes(e)
        attention_out = mla.heads * mla.v_head_dim * e
    # Per live slot and step: the fused [embedding | hidden] input (f32 norms of both halves, the concatenation),
    # the post-attention norm and residual (f32), the query, the slot's own (diagonal) key and value, the
    # attention output, the MLP.
    per_slot = 2 * h * 2 * F32 + 2 * h * F32 + 3 * h * F32 + query + key + attention_out + 4 * i * e
    terms = {
        "decoder layer over the TTT steps": sum(live) * per_slot,
        # Step 0 computes keys and values at every token; the captured features and fc's output.
        "step-0 keys and fused target features": tokens * (key + 3 * h * e + h * e + 2 * h * F32),
        # Per supervised slot and step: the draft's f32 log-softmax and the teacher's f32 softmax.
        "draft and teacher distributions": ttt_length * per_step * 2 * vd * F32,
        # The last step's loss: draft logits, teacher logits over the draft vocabulary, their product.
        "last step's logits": per_step * 4 * vd * F32,
    }
    if cpu:
        terms["CPU tile key gathers"] = (
            sum(2 * cpu_gathered_keys(n, work) for n in live) * shapes.kv_width * e
        )
    return terms


@dataclass(frozen=True)
class MLAWidths:
    """MLA-EAGLE-3's attention widths (lightning_drafts/eagle3/mla_draft.py)."""

    heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    def query_bytes(self, e: int) -> int:
        low_rank = 0 if self.q_lora_rank is None else self.q_lora_rank * (e + 2 * F32)
        head = self.qk_nope_head_dim + self.qk_rope_head_dim
        return low_rank + self.heads * head * (3 * e)

    def key_bytes(self, e: int) -> int:
        # The latent and its norm (f32), its per-head expansion to nope keys and values, the rope key.
        latent = (self.kv_lora_rank + self.qk_rope_head_dim) * e + self.kv_lora_rank * 2 * F32
        expanded = self.heads * (self.qk_nope_head_dim + self.v_head_dim) * e
        keys = self.heads * (self.qk_nope_head_dim + self.qk_rope_head_dim) * 2 * e
        return latent + expanded + keys + self.heads * self.v_head_dim * e
