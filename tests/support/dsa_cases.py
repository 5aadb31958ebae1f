"""Seeded dsa_attention problems, the same layer composed of the public ops,
and its float64 evaluation (CPU and GPU tests). Not a test file."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_attn_dist import indexer_loss, indexer_topk, oracle, sparse_mla

ARRAY_KEYWORDS = ("q_start_index", "cu_seqlens_q", "cu_seqlens_k")


def make_dsa_inputs(seed, *, S, N, H, D, HI, DI, topk, B=None, d_v=None, dtype=jnp.float32, q_start_index=None,
                    causal=True, k_stride=1):
    """``((q, kv, index_q, index_k, weights), keywords)``: normal draws
    scaled so that scores and logits are O(1). ``q_start_index``: None puts
    the first query at ``topk // 2`` (its first rows see fewer than ``topk``
    keys: -1 slots), "batch" draws an int32 [B] of starts, the first -2 (its
    first rows see no key at all)."""
    rng = np.random.default_rng(seed)
    lead = (B,) if B is not None else ()

    def draw(shape, scale=1.0):
        return jnp.asarray((rng.standard_normal(lead + shape) * scale).astype(np.float32), dtype)

    arrays = (draw((S, H, D)), draw((N, 1, D)), draw((S, HI, DI), DI ** -0.25), draw((N, DI), DI ** -0.25),
              jnp.asarray((rng.standard_normal(lead + (S, HI)) * HI ** -0.5).astype(np.float32)))
    if q_start_index is None:
        q_start_index = topk // 2
    elif isinstance(q_start_index, str) and q_start_index == "batch":
        starts = rng.integers(topk // 4, N, (B,))
        starts[0] = -2  # the first element's first rows see no key
        q_start_index = jnp.asarray(starts, jnp.int32)
    kw = dict(sm_scale=float(D ** -0.5 * rng.uniform(0.8, 1.5)), topk=topk, d_v=min(D, 512) if d_v is None else d_v,
              indexer_scale=float(rng.uniform(0.5, 2.0)), causal=causal, q_start_index=q_start_index,
              k_stride=k_stride)
    return arrays, kw


def split_arrays(kw):
    """(static keywords, array keywords): the arrays to pass as jit arguments."""
    static = {k: v for k, v in kw.items() if k not in ARRAY_KEYWORDS or isinstance(v, (int, type(None)))}
    arrays = {k: v for k, v in kw.items() if k not in static}
    return static, arrays


def composed(q, kv, index_q, index_k, weights, *, sm_scale, topk, d_v, indexer_scale, causal=True, q_start_index=0,
             k_stride=1, deterministic=False, indices=None, implementation="xla", **packing):
    """The layer from the public ops, one call each: ``(out, kl, indices,
    lse)``. ``indices`` given: the selection is skipped (for comparing paths
    whose selections may differ at near-ties)."""
    rule = dict(causal=causal, q_start_index=q_start_index, k_stride=k_stride, implementation=implementation,
                **packing)
    if indices is None:
        indices = indexer_topk(index_q, index_k, weights, topk=topk, scale=indexer_scale, **rule)
    out, lse = sparse_mla(q, kv, indices, sm_scale=sm_scale, d_v=d_v, lse_base="e", deterministic=deterministic,
                          **rule)
    kl = indexer_loss(q, kv, lse, index_q, index_k, weights, indices, sm_scale=sm_scale, lse_base="e",
                      scale=indexer_scale, deterministic=deterministic, **rule)
    return out, kl, indices, lse


def oracle_layer(arrays, indices, kw, **packing):
    """float64 ``(out, lse, kl, target)`` of SPEC §10 on the given indices."""
    q, kv, iq, ik, w = arrays
    rule = dict(causal=kw["causal"], q_start_index=np.asarray(kw["q_start_index"]), k_stride=kw["k_stride"],
                **{k: np.asarray(v) for k, v in packing.items()})
    if np.ndim(rule["q_start_index"]) == 0:
        rule["q_start_index"] = int(rule["q_start_index"])
    out, lse = oracle.sparse_mla_oracle(q, kv, indices, sm_scale=kw["sm_scale"], d_v=kw["d_v"], lse_base="e", **rule)
    mass = oracle.attn_dist_oracle(q, kv, indices, lse, sm_scale=kw["sm_scale"], lse_base="e", **rule).sum(axis=-3)
    total = mass.sum(-1, keepdims=True)
    target = np.where(total > 0, mass / np.where(total > 0, total, 1.0), 0.0)
    kl = oracle.indexer_kl_oracle(iq, ik, w, indices, target, scale=kw["indexer_scale"], **rule)
    return out, lse, kl, target


def check_selection(indices, arrays, kw, **packing):
    """Every row's selection is acceptable under SPEC §9.3 for the float64 logits."""
    _, _, iq, ik, w = arrays
    rule = dict(causal=kw["causal"], q_start_index=np.asarray(kw["q_start_index"]), k_stride=kw["k_stride"],
                **{k: np.asarray(v) for k, v in packing.items()})
    logits = oracle.indexer_topk_logits_oracle(iq, ik, w, scale=kw["indexer_scale"], **rule)
    oracle.assert_topk_acceptable(np.asarray(indices), logits, kw["topk"])


def layer_loss(fn, g):
    """The scalar the gradient tests take: ``sum(out * g) + mean(kl)``."""
    def loss(*arrays):
        r = fn(*arrays)
        return jnp.sum(r[0].astype(jnp.float32) * g) + jnp.mean(r[1])

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))
