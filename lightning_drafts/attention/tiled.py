"""Dense masks cut into query tiles: the CPU attention kernel that never touches a key no query sees.

A dense boolean mask ``[B, 1, Q, KV]`` costs ``Q x KV`` score work however little it allows. Packed
rows allow little: under EAGLE-3's block-causal mask a query sees its own document only, and in the
flat block-draft layout (every block of a micro-batch against every real token of it) a block sees
one document's context and itself. A :class:`TiledMask` keeps, for each tile of consecutive queries,
only the key columns some query of the tile sees (per row), so attention costs about the visible area,
as a flex ``BlockMask`` does on the GPU. It is built once per batch and shared by every layer and
TTT step.

Each tile runs PyTorch's fused CPU flash-attention kernel on its gathered keys (no ``Q x KV`` fp32
scores are kept for backward), whose log-sum-exp is differentiable too
(:mod:`~lightning_drafts.attention.cpu_flash`: one backward kernel per tile for both outputs). Off the
CPU (an explicit ``sdpa`` request on CUDA) each tile runs the dense fp32 math.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_drafts.attention.cpu_flash import cpu_flash_attention
from lightning_drafts.attention.kv_heads import expand_kv_heads

# Queries per tile: small enough that a tile spans about one document of chat-length rows, large
# enough that the per-tile kernel launch and key gather stay negligible.
TILE_QUERIES = 256


@dataclass(frozen=True)
class MaskTile:
    """Queries ``[start, stop)`` against ``width`` gathered key columns per row.

    ``bias`` is the fp32 additive mask ``[B, 1, stop - start, width]`` (0 visible, ``-inf`` not);
    ``empty`` flags queries that see no key (``[B, 1, stop - start]``), or is None when every query sees
    one. Their bias rows are all 0 so the kernel stays finite; their outputs are zeroed afterwards.
    """

    start: int
    stop: int
    width: int
    bias: Tensor
    empty: Tensor | None


@dataclass(frozen=True)
class TiledMask:
    """A boolean ``[B, 1, Q, KV]`` mask as query tiles; ``key_index`` holds the flat ``b * KV + column``
    of every gathered key, tile after tile (row-major inside a tile)."""

    tiles: tuple[MaskTile, ...]
    key_index: Tensor
    batch: int
    q_len: int
    kv_len: int

    @property
    def device(self) -> torch.device:
        return self.key_index.device

    def dense(self) -> Tensor:
        """The boolean ``[B, 1, Q, KV]`` mask this tiling stands for (tests and debugging)."""
        mask = torch.zeros(self.batch, 1, self.q_len, self.kv_len, dtype=torch.bool, device=self.device)
        offset = 0
        for tile in self.tiles:
            count = self.batch * tile.width
            columns = self.key_index[offset : offset + count].view(self.batch, tile.width) % self.kv_len
            visible = tile.bias == 0
            if tile.empty is not None:
                visible = visible & ~tile.empty[..., None]
            index = columns[:, None, None, :].expand_as(visible)
            # Columns are distinct within a row, so each lands once; fillers write False.
            mask[:, :, tile.start : tile.stop].scatter_(-1, index, visible)
            offset += count
        return mask

    def select_queries(self, queries: Tensor) -> TiledMask:
        """The mask of the queries ``queries`` alone (long, ascending, distinct), in that order.

        Each tile keeps its key columns and the bias rows of its selected queries; a tile with none
        selected is dropped with its keys. Used where only some queries still need an output (the last
        layer of a block draft, whose other slots feed nothing a loss reads).
        """
        bounds = torch.tensor([tile.start for tile in self.tiles] + [self.q_len], device=queries.device)
        # One host sync for every tile's share of the selection.
        cuts = torch.searchsorted(queries, bounds).tolist()
        tiles, indices, offset = [], [], 0
        for tile, first, last in zip(self.tiles, cuts[:-1], cuts[1:], strict=True):
            count = self.batch * tile.width
            if last > first:
                local = queries[first:last] - tile.start
                empty = None if tile.empty is None else tile.empty.index_select(2, local)
                bias = tile.bias.index_select(2, local)
                tiles.append(MaskTile(first, last, tile.width, bias, empty))
                indices.append(self.key_index[offset : offset + count])
            offset += count
        key_index = torch.cat(indices) if indices else self.key_index[:0]
        return TiledMask(tuple(tiles), key_index, self.batch, int(queries.numel()), self.kv_len)


def visible_columns(visible: Tensor, columns: Tensor) -> tuple[Tensor, Tensor]:
    """Drop the candidate columns no query of a tile sees.

    ``visible`` bool ``[B, tq, C]`` over candidate key ``columns`` (long ``[B, C]``). Returns
    ``(keys [B, n], visible [B, tq, n])`` with ``n`` the most columns any row keeps; each row lists its
    seen columns first, in ascending order, then unseen fillers (masked for every query).
    """
    seen = visible.any(1)
    width = max(int(seen.sum(-1).max()), 1)
    order = torch.sort(seen.to(torch.uint8), dim=-1, descending=True, stable=True).indices[:, :width]
    keys = columns.gather(-1, order)
    return keys, visible.gather(-1, order[:, None, :].expand(-1, visible.shape[1], -1))


def assemble(pieces: Iterable[tuple[int, Tensor, Tensor]], batch: int, q_len: int, kv_len: int) -> TiledMask:
    """A :class:`TiledMask` from ``(start, keys [B, n], visible [B, tq, n])`` per tile, in query order."""
    tiles, indices, expected = [], [], 0
    for start, keys, visible in pieces:
        if start != expected:
            raise ValueError(
                f"mask tiles must cover the queries in order: tile at {start}, expected {expected}"
            )
        stop = start + visible.shape[1]
        empty = ~visible.any(-1)
        bias = torch.zeros(visible.shape, dtype=torch.float32, device=visible.device)
        bias = bias.masked_fill(~visible & ~empty[..., None], float("-inf"))
        has_empty = bool(empty.any())
        tiles.append(
            MaskTile(start, stop, keys.shape[1], bias[:, None], empty[:, None] if has_empty else None)
        )
        rows = torch.arange(batch, device=keys.device)[:, None] * kv_len
        indices.append((rows + keys).reshape(-1))
        expected = stop
    if expected != q_len:
        raise ValueError(f"mask tiles cover {expected} of {q_len} queries")
    device = indices[0].device if indices else torch.device("cpu")
    key_index = torch.cat(indices) if indices else torch.zeros(0, dtype=torch.long, device=device)
    return TiledMask(tuple(tiles), key_index, batch, q_len, kv_len)


def tile_dense_mask(mask: Tensor, tile_queries: int = TILE_QUERIES) -> TiledMask:
    """Tile a boolean ``[B, 1, Q, KV]`` mask (e.g. :func:`~lightning_drafts.attention.block_causal_mask`)."""
    if mask.dim() != 4 or mask.shape[1] != 1 or mask.dtype != torch.bool:
        raise ValueError(
            f"tile_dense_mask needs a boolean [B, 1, Q, KV] mask, got {mask.dtype} {tuple(mask.shape)}"
        )
    batch, _, q_len, kv_len = mask.shape
    columns = torch.arange(kv_len, device=mask.device).expand(batch, kv_len)

    def pieces() -> Iterable[tuple[int, Tensor, Tensor]]:
        for start in range(0, q_len, tile_queries):
            yield start, *visible_columns(mask[:, 0, start : start + tile_queries], columns)

    return assemble(pieces(), batch, q_len, kv_len)


def tiled_attention(
    query: Tensor, key: Tensor, value: Tensor, mask: TiledMask, scale: float, with_lse: bool
) -> tuple[Tensor, Tensor | None]:
    """``[B, H, Q, d_v]`` attention under ``mask`` and the fp32 ``[B, H, Q]`` log-sum-exp when ``with_lse``
    (``-inf`` and a zero output for a query that sees nothing). ``key`` / ``value`` have ``H`` heads or, for
    grouped-query attention, a divisor of ``H`` (query head ``h`` reads head ``h // (H / H_kv)``): only the
    keys a tile sees are gathered, and of the grouped heads alone."""
    batch, heads, q_len, _ = query.shape
    kv_heads = key.shape[1]
    if (batch, q_len, key.shape[2]) != (mask.batch, mask.q_len, mask.kv_len):
        raise ValueError(
            f"attention shapes (B={batch}, Q={q_len}, KV={key.shape[2]}) do not match the tiled mask "
            f"(B={mask.batch}, Q={mask.q_len}, KV={mask.kv_len}); build the mask for this batch"
        )
    if not mask.tiles:
        empty = query.new_zeros(batch, heads, 0, value.shape[-1])
        return empty, query.new_zeros(batch, heads, 0, dtype=torch.float32) if with_lse else None
    keys, values = _gather_rows(key, mask.key_index), _gather_rows(value, mask.key_index)
    # One split per tensor rather than a slice per tile: a slice's backward writes its gradient into a
    # zero tensor of the whole input, so per-tile slices cost a full-size fill and add per tile.
    widths = [batch * tile.width for tile in mask.tiles]
    pieces = zip(
        mask.tiles,
        query.split([tile.stop - tile.start for tile in mask.tiles], dim=2),
        keys.split(widths),
        values.split(widths),
        strict=True,
    )
    outs, lses = [], []
    for tile, q, k, v in pieces:
        k = k.view(batch, tile.width, kv_heads, -1).transpose(1, 2)
        v = v.view(batch, tile.width, kv_heads, -1).transpose(1, 2)
        out, lse = _tile_attention(q, k, v, tile, scale)
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs, dim=2), torch.cat(lses, dim=2) if with_lse else None


def _gather_rows(x: Tensor, index: Tensor) -> Tensor:
    # One gather for all tiles: its backward is one index_add instead of a full-size zero tensor per tile.
    return x.transpose(1, 2).reshape(-1, x.shape[1], x.shape[3]).index_select(0, index)


def _tile_attention(
    query: Tensor, key: Tensor, value: Tensor, tile: MaskTile, scale: float
) -> tuple[Tensor, Tensor]:
    """The tile's output and its log-sum-exp (both differentiable; the log-sum-exp costs nothing unless a
    gradient reaches it)."""
    if query.device.type == "cpu":
        out, lse = cpu_flash_attention(query, key, value, scale, bias=tile.bias.to(query.dtype))
    else:
        out, lse = _dense_math(query, key, value, tile, scale)
    if tile.empty is not None:
        out = out.masked_fill(tile.empty[..., None], 0.0)
        lse = lse.masked_fill(tile.empty, float("-inf"))
    return out, lse


def _dense_math(
    query: Tensor, key: Tensor, value: Tensor, tile: MaskTile, scale: float
) -> tuple[Tensor, Tensor]:
    key, value = expand_kv_heads(query, key, value)
    scores = torch.matmul(query.float(), key.float().transpose(-1, -2)) * scale + tile.bias
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse.unsqueeze(-1))
    return torch.matmul(probs.to(value.dtype), value), lse
