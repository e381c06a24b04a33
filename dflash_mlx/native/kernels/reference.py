"""Block attention in plain MLX ops, for CPU and for when the Metal kernel is off."""

import mlx.core as mx


def reference_attention(
    queries: mx.array,
    ctx_keys: mx.array,
    ctx_values: mx.array,
    block_keys: mx.array,
    block_values: mx.array,
    scale: float,
) -> mx.array:
    """Softmax attention over context then block keys, without concatenating them.

    The two score blocks share one max and one denominator, so the context
    cache (often a slice of a bigger buffer) is read in place rather than
    copied next to the block every call; see metal/README.md for timings.
    """
    b, n_q_heads, block_len, head_dim = queries.shape
    n_kv_heads = block_keys.shape[1]
    # GQA: query head h uses kv head h // G, so (G, L) query rows share a kv head.
    q = (queries * scale).reshape(b, n_kv_heads, -1, head_dim)
    sources = [(block_keys, block_values)]
    if ctx_keys.shape[2] > 0:
        sources.insert(0, (ctx_keys, ctx_values))
    scores = [(q @ k.swapaxes(-1, -2)).astype(mx.float32) for k, _ in sources]
    row_max = scores[0].max(axis=-1, keepdims=True)
    for s in scores[1:]:
        row_max = mx.maximum(row_max, s.max(axis=-1, keepdims=True))
    denom = out = None
    for s, (_, v) in zip(scores, sources, strict=True):
        p = mx.exp(s - row_max)
        part, total = p.astype(v.dtype) @ v, p.sum(axis=-1, keepdims=True)
        # summed from the first term, not from 0: one op fewer each, the same sums
        denom = total if denom is None else denom + total
        out = part if out is None else out + part
    out = (out / denom).astype(queries.dtype)
    return out.reshape(b, n_q_heads, block_len, head_dim)
