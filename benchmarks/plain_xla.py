"""SPEC's computations written plainly in XLA, as a user would write them for
speed without the package: the XLA side of the benchmark rows (their
``xla_*`` fields), beside the package's own jnp paths (``jnp_*``: the
contract's float32 references, which form P.V in float32 at HIGHEST
precision, off the tensor cores).

They compute at the kernels' precision where a plain jnp program does:
bf16 products accumulated in float32, the softmax in float32, P rounded to
bf16 before P.V. Their gradients are XLA's autodiff: its backward products
take the float32 cotangents as they come, at XLA's default precision.
Sparse MLA gathers its kv rows from a float32 copy, cast to bf16 for the
products, so that their gradient is summed in float32 as the kernel sums
it (gathering bf16 rows with a float32-summing transpose instead was
slower: mla-v32-h128's forward 22.80 ms against 17.55, in two calls on an
H200); the indexer loss's ``index_k`` rows are gathered in bf16 and their
gradient summed by XLA's scatter in bf16. Sparse MLA runs in chunks of
query rows (``lax.map``, so that its temporaries do not grow with S), each
chunk's scores and softmax recomputed in the backward (``jax.checkpoint``),
as the kernel recomputes P, or (``remat=False``) every chunk's residuals
kept from the forward instead (some 15-20 GB at the v32 shapes)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_attn_dist._core import chunks
from jax_attn_dist._core.chunks import LOG2E

#: Query rows per chunk (sparse MLA's gathered rows: about 0.9 GB a chunk at
#: the v32 shapes, in float32 and bf16).
CHUNK_ROWS = 128


def valid_slots(idx, positions, *, N, causal, q_start_index, k_stride):
    """SPEC §2's rule (the package's own exact form) for the slots ``idx``
    [R, T] of the query rows at ``positions`` [R], the query at
    ``q_start_index + position``."""
    qq, qr = chunks.causal_parts(jnp.asarray(q_start_index, jnp.int32).reshape(1), k_stride)
    rows = jnp.zeros(idx.shape[:1], jnp.int32)  # one batch element
    valid, _ = chunks.valid_slots(idx[:, None, :], rows, positions, qq, qr, None, N=N, causal=causal,
                                  k_stride=k_stride)
    return valid[:, 0, :]


def map_row_chunks(fn, chunk, *operands):
    """``fn`` over chunks of ``chunk`` rows under ``lax.map``: ``operands``
    are ``(array, fill)`` pairs sharing their first dimension S, padded with
    ``fill`` to whole chunks; ``fn``'s outputs come back [S, ...]."""
    S = operands[0][0].shape[0]
    C = max(min(chunk, S), 1)  # S = 0: no chunk
    pad = -S % C
    xs = [jnp.pad(a, ((0, pad),) + ((0, 0),) * (a.ndim - 1), constant_values=fill).reshape((-1, C) + a.shape[1:])
          for a, fill in operands]
    out = jax.lax.map(fn, xs)
    return jax.tree.map(lambda y: y.reshape((-1,) + y.shape[2:])[:S], out)


def xla_sparse_mla(q, kv, indices, *, sm_scale, d_v, causal, q_start_index, k_stride, lse_base, chunk=CHUNK_ROWS,
                   remat=True):
    """SPEC §8's ``(out, lse)`` for unbatched q [S, H, D], kv [N, 1, D],
    indices [S, 1, T]: per chunk of rows, the selected kv rows gathered, the
    scores and P.V as bf16 products accumulated in float32, the softmax in
    float32 and P rounded to q's dtype before P.V (as the kernel rounds it);
    a row with no valid slot gets out 0 and lse -inf."""
    S = q.shape[0]
    N = kv.shape[0]
    table32 = kv[:, 0].astype(jnp.float32)

    def one_chunk(args):
        qc, ic, positions = args
        valid = valid_slots(ic, positions, N=N, causal=causal, q_start_index=q_start_index, k_stride=k_stride)
        kg = table32[jnp.where(valid, ic, 0)].astype(q.dtype)                              # [C, T, D]
        z = jnp.einsum("chd,ctd->cht", qc, kg, preferred_element_type=jnp.float32) * jnp.float32(sm_scale)
        z = jnp.where(valid[:, None, :], z, -jnp.inf)
        m = jax.lax.stop_gradient(jnp.max(z, axis=-1, keepdims=True))
        m = jnp.where(jnp.isfinite(m), m, 0.0)
        e = jnp.exp(z - m)
        l = jnp.sum(e, axis=-1, keepdims=True)
        has = l > 0
        l_safe = jnp.where(has, l, 1.0)
        p = (e / l_safe).astype(q.dtype)
        out = jnp.einsum("cht,ctd->chd", p, kg[..., :d_v], preferred_element_type=jnp.float32)
        return out.astype(q.dtype), jnp.where(has, m + jnp.log(l_safe), -jnp.inf)[..., 0]

    out, lse = map_row_chunks(jax.checkpoint(one_chunk) if remat else one_chunk, chunk, (q, 0), (indices[:, 0], -1),
                              (jnp.arange(S, dtype=jnp.int32), 0))
    return out, (lse * jnp.float32(LOG2E) if lse_base == "2" else lse)


def xla_attn_target(q, kv, indices, lse, *, sm_scale, causal, q_start_index, k_stride, chunk=CHUNK_ROWS):
    """indexer_loss's target: each row's attention mass on its valid slots,
    ``sum_h exp(sm_scale q_h . kv[i] - lse_h)`` (lse in base e; heads with a
    non-finite lse add nothing), L1-normalised (rows with no mass 0), the
    scores as bf16 products accumulated in float32. Unbatched q [S, H, D],
    kv [N, 1, D], indices [S, 1, T], lse [S, H] -> [S, T]. No gradient (the
    layer's teacher)."""
    S = q.shape[0]
    N = kv.shape[0]

    def one_chunk(args):
        qc, ic, lc, positions = args
        valid = valid_slots(ic, positions, N=N, causal=causal, q_start_index=q_start_index, k_stride=k_stride)
        kg = kv[jnp.where(valid, ic, 0), 0]                                                # [C, T, D]
        z = jnp.einsum("chd,ctd->cht", qc, kg, preferred_element_type=jnp.float32) * jnp.float32(sm_scale)
        p = jnp.where(valid[:, None, :] & jnp.isfinite(lc)[..., None], jnp.exp(z - lc[..., None]), 0.0)
        mass = p.sum(axis=1)                                                               # [C, T]
        total = mass.sum(axis=-1, keepdims=True)
        return jnp.where(total > 0, mass / jnp.where(total > 0, total, 1.0), 0.0)

    return jax.lax.stop_gradient(map_row_chunks(one_chunk, chunk, (q, 0), (indices[:, 0], -1), (lse, -jnp.inf),
                                                (jnp.arange(S, dtype=jnp.int32), 0)))


def xla_indexer_kl(index_q, index_k, weights, indices, target, *, scale, causal, q_start_index, k_stride):
    """SPEC §5's loss: gather + einsum + relu-weighted sum + masked
    log_softmax + KL, everything materialised ([S, HI, T] float32 scores)."""
    S = index_q.shape[0]
    N = index_k.shape[0]
    idx = indices[:, 0, :]
    valid = valid_slots(idx, jnp.arange(S, dtype=jnp.int32), N=N, causal=causal, q_start_index=q_start_index,
                        k_stride=k_stride)
    kg = index_k[jnp.clip(idx, 0, N - 1)]                                        # [S, T, DI]
    z = jnp.einsum("shd,std->sht", index_q, kg, preferred_element_type=jnp.float32)
    logits = scale * jnp.einsum("sh,sht->st", weights.astype(jnp.float32), jax.nn.relu(z))
    log_p = jax.nn.log_softmax(jnp.where(valid, logits, -1e30), axis=-1)
    t = jnp.where(valid & (target > 0), target, 0.0)
    pos = t > 0
    return jnp.sum(jnp.where(pos, t * (jnp.log(jnp.where(pos, t, 1.0)) - log_p), 0.0), axis=-1)
