"""DeepSeek-V3.2's sparse attention (deepseek_v32, glm_moe_dsa) in a verify forward, computed
for each position as one-token decoding computes it.

mlx-lm writes this attention two ways. One query (decoding) attends in the latent space: its
indexer sums the heads' scores with `sum`, the keys it selects are gathered in the order
`argpartition` returns them, and the query is absorbed through `embed_q` and the output
through `unembed_out`. Several queries (a prompt, a verify forward) expand every cached latent
into per-head keys and values, sum the indexer's heads one by one, select from rows masked
to the causal width and mask the keys left out. Both are exact in real arithmetic, but they
round differently, and a selection takes the top k of scores where rounding (or a tie broken
over a row of another length) can swap the last key in: a verify forward's query could then
attend to other keys than decoding's at the same position, and greedy output part from
mlx-lm's.

`verify_class` gives the attention a class for verify forwards over several positions whose
`__call__` computes what decoding computes at each position, at once for all: the
projections, norms and RoPEs over all positions; each query's top k by `argpartition` over
exactly the keys that query sees (one small call per position, so that ties break as in
decoding, and the keys come in its order); then every query as a batch entry of its own, with
decoding's shapes (as mlx-lm's deepseek_v41 attends), over its gathered latents in the
absorbed form. Given the same inputs its output has decoding's bits
(tests/test_sparse_attention.py). What else would round otherwise in a verify forward
(`cpu_math`'s exps in SwiGLUs, a GPU's products over several rows) `backends.verify_swaps`
leaves out for a target with this attention: a selection turns the last bit into other keys.
Tree forwards (whose queries see their ancestors only) keep
mlx-lm's several-query path, which is why such a target refuses trees
(`target.TREE_REFUSALS`).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.base import scaled_dot_product_attention
from mlx_lm.models.deepseek_v32 import DeepseekV32Attention, Indexer

from . import hooks

SPARSE_ATTENTIONS = (DeepseekV32Attention,)
_CLASSES: dict[type, type] = {}


def verify_class(cls: type) -> type:
    """The class a sparse attention of class `cls` (a subclass of one of `SPARSE_ATTENTIONS`:
    its own or a backend's swap) takes in a verify forward over several positions."""
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"Decoding{cls.__name__}", (cls,), {"__call__": _verify_call})
    return _CLASSES[cls]


def _verify_call(self: DeepseekV32Attention, x: mx.array, mask: Any = None, cache: Any = None):
    """The attention of several positions, each query's as a one-token forward computes it."""
    batch, length, _ = x.shape
    if cache is None or hooks.tree_of(cache[0]) is not None:
        return super(type(self), self).__call__(x, mask, cache)
    qr = self.q_a_layernorm(self.q_a_proj(x))
    q = self.q_b_proj(qr).reshape(batch, length, self.num_heads, self.q_head_dim)
    q_nope, q_pe = mx.split(q.transpose(0, 2, 1, 3), [self.qk_nope_head_dim], axis=-1)
    latent, k_pe = mx.split(self.kv_a_proj_with_mqa(x), [self.kv_lora_rank], axis=-1)
    k_pe = k_pe.reshape(batch, length, 1, self.qk_rope_head_dim).transpose(0, 2, 1, 3)
    latent = mx.expand_dims(self.kv_a_layernorm(latent), axis=1)
    offset = cache[0].offset
    q_pe, k_pe = self.rope(q_pe, offset), self.rope(k_pe, offset)
    latents, k_pe = cache[0].update_and_fetch(latent, k_pe)
    selected, valid = _selections(self.indexer, x, qr, cache[1], offset)
    cache[0].keys = mx.depends(cache[0].keys, (cache[1].keys, cache[1].values))
    keys, pe = _per_query(latents, selected), _per_query(k_pe, selected)
    pe_scores = (_per_query(q_pe) * self.scale) @ pe.swapaxes(-1, -2)
    if valid is not None:  # a query that sees fewer keys than the others
        floor = mx.array(mx.finfo(pe_scores.dtype).min, pe_scores.dtype)
        pe_scores = mx.where(valid.reshape(batch * length, 1, 1, -1), pe_scores, floor)
    query = self.embed_q(_per_query(q_nope))
    out = scaled_dot_product_attention(
        query, keys, keys, cache=cache, scale=self.scale, mask=pe_scores
    )
    return self.o_proj(self.unembed_out(out).reshape(batch, length, -1))


def _selections(
    indexer: Indexer, x: mx.array, qr: mx.array, cache: Any, offset: int
) -> tuple[mx.array, mx.array | None]:
    """The keys each position's query attends to (B, L, k), as a one-token forward selects
    them: its indexer's top k over exactly the keys it sees, in `argpartition`'s order, or all
    it sees where those are no more than top k; and which of the k are real (None: all), the
    rest padding. The new index keys are appended to `cache`."""
    batch, length, _ = x.shape
    q = indexer.wq_b(qr).reshape(batch, length, indexer.n_heads, indexer.head_dim)
    k = indexer.k_norm(indexer.wk(x)).reshape(batch, 1, length, indexer.head_dim)
    q, k = indexer.rope(q.swapaxes(1, 2), offset=offset), indexer.rope(k, offset=offset)
    k, _ = cache.update_and_fetch(k, k)
    cache.values = mx.zeros_like(cache.keys)  # as mlx-lm's indexer: no graph kept growing
    top_k, seen = indexer.index_topk, [offset + i + 1 for i in range(length)]
    width = min(top_k, seen[-1])
    every = mx.broadcast_to(mx.arange(width), (batch, 1, width))
    if seen[-1] > top_k:
        weights = indexer.weights_proj(x) * (indexer.n_heads**-0.5 * indexer.softmax_scale)
        scores = mx.maximum(q @ k.swapaxes(-1, -2), 0) * weights.swapaxes(-1, -2)[..., None]
        scores = scores.sum(axis=1)  # (B, L, keys): the heads summed as for one query
    rows = [
        every
        if n <= top_k
        else mx.argpartition(scores[:, i : i + 1, :n], kth=-top_k, axis=-1)[..., -top_k:]
        for i, n in enumerate(seen)
    ]
    selected = mx.stop_gradient(mx.concatenate(rows, axis=1))
    if seen[0] >= width:
        return selected, None
    real = mx.arange(width)[None] < mx.array(seen)[:, None]
    return selected, mx.broadcast_to(real, (batch, length, width))


def _per_query(rows: mx.array, selected: mx.array | None = None) -> mx.array:
    """(B * L, heads, 1, d): each position's query (`rows` (B, heads, L, d)) as a batch entry of
    its own, as a one-token forward has it; or, with `selected` (B, L, k), the rows (B, 1, n, d)
    it picks for each position's query, (B * L, 1, k, d), in its order."""
    if selected is None:
        batch, heads, length, dim = rows.shape
        return rows.transpose(0, 2, 1, 3).reshape(batch * length, heads, 1, dim)
    batch, length, k = selected.shape
    shape = (batch, length, k, rows.shape[-1])
    picked = mx.take_along_axis(rows, mx.broadcast_to(selected[..., None], shape), axis=2)
    return picked.reshape(batch * length, 1, k, rows.shape[-1])
