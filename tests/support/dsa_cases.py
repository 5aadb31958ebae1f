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


# ----------------------------------------------------------------------------
# the layer's results and gradients against float64 (SPEC §10.3), shared by the
# GPU tests (the kernels) and the CPU tests (the same checks on the jnp paths)
# ----------------------------------------------------------------------------

def check_forward_against_oracle(r, arrays, kw):
    """SPEC §10.3 on the layer's own indices: ``out`` and ``lse`` by §8.2
    (out: both of §3.1's measures within SPARSE_MLA_OUT_TOLERANCE; lse:
    SPARSE_MLA_LSE_TOLERANCE absolute where finite, -inf exactly where the
    float64 one is), ``indexer_kl`` by §3.2 (INDEXER_TOLERANCE) against the
    float64 KL towards the float64 target. Returns the measured errors and
    the oracle's ``(out, lse, kl, target)``."""
    from sparse_mla_cases import assert_out_and_lse

    ref = oracle_layer(arrays, np.asarray(r.indices), kw)
    ref_out, ref_lse, ref_kl, _ = ref
    out_rel, out_max, lse_err = assert_out_and_lse(r.out, r.lse, ref_out, ref_lse,
                                                   out_tol=oracle.SPARSE_MLA_OUT_TOLERANCE,
                                                   lse_tol=oracle.SPARSE_MLA_LSE_TOLERANCE)
    oracle.assert_indexer_close(r.indexer_kl, ref_kl)
    assert float(np.asarray(r.indexer_kl).max()) > 0, "degenerate problem: the KL is all 0"
    errors = dict(out_rel=out_rel, out_max=out_max, lse=lse_err, kl=oracle.indexer_error(r.indexer_kl, ref_kl))
    return errors, ref


def sparse_mla_grads_f64(q, kv, indices, dout, *, sm_scale, d_v, causal, q_start_index, k_stride, rows=16):
    """float64 ``(dq, dkv)`` of ``sum(dout * out)`` per SPEC §8.3 (dlse = 0)
    for the layer's HK = 1, batched, unpacked: the formulas of
    ``oracle.sparse_mla_grads_oracle`` with the same validity rule, but
    with each row block's sums over heads and slots as matrix products (the
    oracle forms a D-vector per valid slot and head: minutes at the GPU
    tests' size). ``test_api.py`` checks it against the oracle."""
    q64, dout64 = oracle.to_f64(q), np.asarray(dout, np.float64)
    assert q64.ndim == 4, "batched problems only"
    idx = np.asarray(indices).astype(np.int64)
    B, S, H, D = q64.shape
    N = kv.shape[1]
    assert kv.shape[2] == 1 and idx.shape[2] == 1, "HK = 1 only"
    valid = oracle.valid_mask(idx, N, causal=causal, q_start_index=np.asarray(q_start_index),
                              k_stride=k_stride)[:, :, 0, :]                   # [B, S, T]
    dq, dkv = np.zeros_like(q64), np.zeros((B, N, D))
    for b in range(B):
        for s0 in range(0, S, rows):
            s1 = min(S, s0 + rows)
            v = valid[b, s0:s1]                                                  # [s, T]
            keys = idx[b, s0:s1, 0]
            kg = oracle.to_f64(np.asarray(kv[b])[np.clip(keys, 0, max(N - 1, 0)), 0])  # [s, T, D]
            qb, do = q64[b, s0:s1], dout64[b, s0:s1]                            # [s, H, D], [s, H, d_v]
            z = np.where(v[:, None, :], sm_scale * (qb @ kg.swapaxes(-1, -2)), -np.inf)  # [s, H, T]
            m = z.max(-1, keepdims=True)
            e = np.exp(z - np.where(np.isfinite(m), m, 0.0))
            total = e.sum(-1, keepdims=True)
            p = e / np.where(total > 0, total, 1.0)
            dp = do @ kg[..., :d_v].swapaxes(-1, -2)                              # [s, H, T]
            ds = p * (dp - (p * dp).sum(-1, keepdims=True))
            dq[b, s0:s1] = sm_scale * (ds @ kg)
            terms = sm_scale * (ds.swapaxes(-1, -2) @ qb)                        # [s, T, D]
            terms[..., :d_v] += p.swapaxes(-1, -2) @ do
            np.add.at(dkv[b], keys[v], terms[v])
    return dq, dkv[:, :, None, :]


def layer_grads_f64(arrays, kw, indices, g, ref_target):
    """The float64 side of ``check_layer_grads`` (computed once, checked
    against several runs): the gradients of ``sum(out * g) + mean(kl)``
    (``layer_loss``) on the layer's ``indices``. d q and d kv by SPEC §8.3
    from ``out``'s cotangent ``g`` rounded to out's dtype (as the convert's
    transpose rounds it); d index_q, d index_k and d weights by §5.3
    towards the float64 target ``ref_target`` (``oracle_layer``'s), with
    the cotangent 1 / (B S) per row, with their per-element magnitudes for
    §3.2's bound; and the entries that take no gradient: dq of a row with
    no valid slot, dkv of a key in no row's valid slots (not the float64
    zeros: a row with one valid key has dS = P (dP - Delta) = 0 only in
    exact arithmetic)."""
    q, kv, iq, ik, w = arrays
    rule = dict(causal=kw["causal"], q_start_index=np.asarray(kw["q_start_index"]), k_stride=kw["k_stride"])
    idx = np.asarray(indices)
    dout = np.asarray(jnp.asarray(g, q.dtype).astype(jnp.float32))
    mla = sparse_mla_grads_f64(q, kv, idx, dout, sm_scale=kw["sm_scale"], d_v=kw["d_v"], **rule)
    rows = np.full(np.shape(ref_target)[:-1], 1.0 / np.prod(np.shape(ref_target)[:-1]))
    indexer = oracle.indexer_grads_oracle(iq, ik, w, idx, ref_target, rows, scale=kw["indexer_scale"],
                                          magnitudes=True, **rule)
    valid = oracle.valid_mask(idx, kv.shape[1], **rule)[:, :, 0, :]
    selected = np.zeros(kv.shape[:2], bool)
    for b in range(selected.shape[0]):
        selected[b, idx[b, :, 0][valid[b]].astype(np.int64)] = True
    return mla, indexer, (~valid.any(-1), ~selected)


def check_layer_grads(grads, arrays, reference):
    """``layer_loss``'s five gradients against ``reference``
    (``layer_grads_f64``): d q and d kv within SPEC §8.3's accuracy
    (relative Frobenius GRAD_TOL, max-abs GRAD_MAX_TOL of the largest
    entry), in the inputs' dtypes, exactly 0 where they take no gradient;
    d index_q, d index_k and d weights within SPEC §3.2's per-element bound
    for the backward kernel. Returns the measured errors: (relative
    Frobenius, max-abs) for dq and dkv, (largest error / its element's
    bound, relative Frobenius, max-abs) for the indexer's."""
    from indexer_cases import BWD_TOLERANCE, assert_bwd_within_bound
    from sparse_mla_cases import assert_grad_close

    mla, (want, mags, ambiguous), no_gradient = reference
    errors = {}
    for name, got, ref, x, dead in zip(("q", "kv"), grads[:2], mla, arrays[:2], no_gradient):
        assert got.dtype == x.dtype, f"d{name}: {got.dtype}, not {x.dtype}"
        errors[f"d{name}"] = assert_grad_close(f"d{name}", got, ref, zero=dead)
    for name, ref in zip(("index_q", "index_k", "weights"), want):
        assert np.abs(ref).max() > 0, f"degenerate problem: the float64 d{name} is all 0"
    assert_bwd_within_bound(grads[2:], want, mags, ambiguous)
    for name, got, ref, mag, amb in zip(("index_q", "index_k", "weights"), grads[2:], want, mags, ambiguous):
        got = np.asarray(jnp.asarray(got, jnp.float32), np.float64)
        bound = BWD_TOLERANCE * mag + amb + 1e-6 * np.abs(ref).max()
        errors[f"d{name}"] = (float(np.max(np.abs(got - ref) / bound)),) + oracle.spec_errors(got, ref)
    return errors
