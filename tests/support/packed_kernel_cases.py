"""SPEC §6 on the CUDA kernels: the checks ``packing/test_gpu.py`` runs under
pytest and ``sanitizer_run.py`` under compute-sanitizer. Not a test file.

* Packed calls through the public functions (``implementation="cuda"``)
  against the float64 oracle's reading of §6.
* The kernels on raw row ranges (SPEC §6's ``row_ranges`` operand, int32
  [B, S, 3]: key_begin, key_end, topk_length) holding adversarial values,
  into NaN-poisoned outputs, against the clamp rule of
  csrc/common/slot_validity.cuh read independently (:func:`ranges_mask`:
  keys into [0, N], the length into [0, T]) and the float64 oracle on the
  indices that rule leaves valid. ``far=True`` (the sanitizer's ``ranges``
  mode) draws key ranges far past N, negative and at the int32 extremes,
  ends before beginnings, lengths far past T or negative, and indices
  inside those far ranges but past N. Under memcheck (sanitizer_run.py's
  ranges mode sets :data:`EXACT_KEY_ALLOCATIONS`) the key operands then live
  in allocations of their exact size, so that with B = 1 a kernel's read of
  a key row past N - 1 (or before row 0) is an error memcheck reports.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

import attn_dist_cases
import indexer_cases
from indexer_cases import assert_bwd_within_bound
from inputs import INT32_MAX, INT32_MIN, make_indexer_inputs, seed_of
from jax_attn_dist import attn_dist, indexer_kl, oracle
from jax_attn_dist._core import checks
from jax_attn_dist.ops.attn_dist import contract as attn_contract
from jax_attn_dist.ops.indexer import contract as indexer_contract
from packed_cases import CASES, attn_problem, indexer_problem, no_owner_rows, traced_call

BF16 = jnp.bfloat16

#: Set by sanitizer_run.py's ranges mode. XLA's buffers live in pooled device
#: memory (its platform allocator too), where memcheck does not see a read
#: past a buffer's end: it lands in the pool. With this set, the key operands
#: (attn_dist's k, the indexer's index_k) are copied into a cudaMalloc of
#: their exact size (CuPy, no pool) and handed to the jitted kernel call
#: without a copy (DLPack, as uint16 bits bitcast back to bfloat16 inside the
#: call), so that memcheck reports any read of theirs past the end (or before
#: the start) of that allocation.
EXACT_KEY_ALLOCATIONS = False
_exact = []  # the CuPy arrays behind those operands


def key_operand(x):
    """``x`` (bfloat16 [B, N, ...]) as the jitted kernel calls below take it:
    itself, or with EXACT_KEY_ALLOCATIONS its bits in an exact allocation."""
    if not EXACT_KEY_ALLOCATIONS:
        return x
    import cupy as cp

    bits = np.ascontiguousarray(np.asarray(x).view(np.uint16))
    mem = cp.cuda.memory.MemoryPointer(cp.cuda.memory.Memory(max(bits.nbytes, 1)), 0)  # cudaMalloc, no pool
    arr = cp.ndarray(bits.shape, cp.uint16, memptr=mem)
    arr.set(bits)
    _exact.append(arr)
    return jnp.from_dlpack(arr)


def as_bf16(x):
    """Inside a jitted call: a key operand back as bfloat16 (a bitcast)."""
    return jax.lax.bitcast_convert_type(x, BF16) if x.dtype == jnp.uint16 else x

# A kernel-sized packed case: 4 sequences of unequal length, an empty one,
# padding rows and keys, per-sequence starts, and rows with short top-k.
BIG = dict(name="big", S=512, N=560, T=192, cu_q=[0, 150, 150, 350, 500], cu_k=[0, 160, 160, 380, 540],
           q_start=[0, 7, 100, 33], topk=list(np.random.default_rng(0).integers(-5, 250, 512)))
GPU_CASES = [c for c in CASES if c["name"] in ("several", "k-stride-2", "topk-packed", "topk-alone",
                                               "rows-before-first", "bad-decreasing-q", "bad-k-past-N")] + [BIG]


# ----------------------------------------------------------------------------
# packed calls through the public functions
# ----------------------------------------------------------------------------


def check_attn_dist_kernel_on_packed_inputs(case):
    q, k, idx, lse, rule, pk = attn_problem(case, H=64, D=576, dtype=BF16)
    fn = functools.partial(attn_dist, implementation="cuda")
    text = jax.jit(lambda *a: fn(*a, **rule, **pk)).lower(q, k, idx, lse).as_text()
    assert attn_contract.FFI_TARGET in text
    got = np.asarray(traced_call(fn, (q, k, idx, lse), rule, pk))
    want = oracle.attn_dist_oracle(q, k, idx, lse, **rule, **pk)
    if np.abs(want).max() == 0:
        assert np.all(got == 0)
    else:
        oracle.assert_within_spec(got, want)
    for s in no_owner_rows(case):
        assert np.all(got[:, s] == 0)


def check_indexer_kernels_on_packed_inputs(case, deterministic):
    iq, ik, w, idx, tgt, rule, pk = indexer_problem(case, dtype=BF16, HI=64, DI=128)
    fn = functools.partial(indexer_kl, implementation="cuda", deterministic=deterministic)
    got = np.asarray(traced_call(fn, (iq, ik, w, idx, tgt), rule, pk))
    oracle.assert_indexer_close(got, oracle.indexer_kl_oracle(iq, ik, w, idx, tgt, **rule, **pk))
    for s in no_owner_rows(case):
        assert got[s] == 0.0
    g = jnp.asarray(np.random.default_rng(seed_of("packed-gpu-grad", case["name"])).standard_normal(case["S"]),
                    jnp.float32)
    grad = jax.jit(jax.grad(lambda a, b, c: jnp.sum(g * fn(a, b, c, idx, tgt, **rule, **pk)), argnums=(0, 1, 2)))
    assert indexer_contract.BWD_FFI_TARGET in grad.lower(iq, ik, w).as_text()
    got_g = grad(iq, ik, w)
    assert_bwd_within_bound(got_g, *oracle.indexer_grads_oracle(iq, ik, w, idx, tgt, g, **rule, magnitudes=True,
                                                                **pk))
    if deterministic:
        for a, b in zip(got_g, grad(iq, ik, w)):
            assert np.asarray(a).tobytes() == np.asarray(b).tobytes()


# ----------------------------------------------------------------------------
# raw row ranges: the kernels' own clamping, and the skipped blocks
# ----------------------------------------------------------------------------


def adversarial_row_ranges(rng, B, S, N, T, far=False):
    """int32 [B, S, 3] (key_begin, key_end, topk_length): ordinary ranges
    mixed with every kind of out-of-range value (negative, past N or T,
    begin > end, INT32_MIN/MAX), and lengths on block edges (0, 1, 63, 64,
    65, ...). ``far``: most rows' ranges reach far past N (to 2N, 3N, N +
    1000, INT32_MAX - 1) or below 0 (-N, INT32_MIN + 1), often ending before
    they begin, and lengths of 10 T, -T and the extremes."""
    keys = np.array([INT32_MIN, -7, -1, 0, 1, N // 2, N - 1, N, N + 1, INT32_MAX], np.int64)
    lengths = np.array([INT32_MIN, -1, 0, 1, 63, 64, 65, 127, 128, T - 1, T, T + 1, INT32_MAX], np.int64)
    if far:
        keys = np.concatenate([keys, [INT32_MIN + 1, -N, N + 2, 2 * N, 3 * N, N + 1000, INT32_MAX - 1]])
        lengths = np.concatenate([lengths, [-T, 2 * T, 10 * T, INT32_MAX - 1, INT32_MIN + 1]])
    begin = rng.integers(0, N, (B, S))
    end = begin + rng.integers(-3, N, (B, S))
    begin = np.where(rng.random((B, S)) < 0.3, keys[rng.integers(0, len(keys), (B, S))], begin)
    end = np.where(rng.random((B, S)) < 0.3, keys[rng.integers(0, len(keys), (B, S))], end)
    length = np.where(rng.random((B, S)) < 0.6, lengths[rng.integers(0, len(lengths), (B, S))],
                      rng.integers(0, T + 1, (B, S)))
    if far:
        reach = rng.random((B, S))
        end = np.where(reach < 0.5, begin + rng.integers(N, 4 * N, (B, S)), end)                # past N
        begin = np.where((reach >= 0.5) & (reach < 0.7), -rng.integers(1, 2 * N, (B, S)), begin)  # below 0
        end = np.where((reach >= 0.7) & (reach < 0.8), begin - rng.integers(1, N + 2, (B, S)), end)  # end < begin
    length[0, 0] = 0  # a row with no live block (its CTA loads nothing)
    out = np.stack([begin, end, length], axis=-1)
    return np.clip(out, INT32_MIN, INT32_MAX).astype(np.int32)


def key_bounds(ranges, N):
    """int64 ``(begin, end)`` [B, S]: each row's key range under the clamp
    of checks.ROW_RANGE_FIELDS (begin into [0, N], end into [begin, N]), in
    Python integers (independent of the kernels' and the jnp path's)."""
    r = np.asarray(ranges).astype(np.int64)
    begin = np.clip(r[..., 0], 0, N)
    return begin, np.clip(r[..., 1], begin, N)


def ranges_mask(indices, ranges, N):
    """bool [B, S, 1, T]: the row-range rule of checks.ROW_RANGE_FIELDS in
    Python integers (independent of the kernels' and the jnp path's)."""
    idx = np.asarray(indices).astype(np.int64)
    T = idx.shape[-1]
    begin, end = key_bounds(ranges, N)
    length = np.clip(np.asarray(ranges).astype(np.int64)[..., 2], 0, T)
    j = np.arange(T)
    return ((idx >= begin[:, :, None, None]) & (idx < end[:, :, None, None])
            & (j < length[:, :, None, None]))


def adversarial_indices(rng, B, S, T, N, far=False):
    """int32 [B, S, 1, T]: keys in [0, N) with duplicates, 15% of them out of
    range (INT32_MIN, -1, N, INT32_MAX); ``far``: a further 30% past N but
    inside the far key ranges (N .. 4N), or below 0."""
    idx = rng.integers(0, N, (B, S, 1, T)).astype(np.int64)
    bad = np.array([INT32_MIN, -1, N, INT32_MAX], np.int64)
    idx = np.where(rng.random(idx.shape) < 0.15, bad[rng.integers(0, 4, idx.shape)], idx)
    if far:
        beyond = np.where(rng.random(idx.shape) < 0.8, rng.integers(N, 4 * N, idx.shape),
                          -rng.integers(1, 2 * N, idx.shape))
        idx = np.where(rng.random(idx.shape) < 0.3, beyond, idx)
    idx[..., 1] = idx[..., 0]  # duplicates
    return idx.astype(np.int32)


def check_attn_dist_kernel_on_raw_row_ranges(H, D, S, *, B=2, N=300, T=200, far=False):
    """attn_dist's kernel on adversarial row ranges (with causal=True and a
    random q_start, which the ranges replace) into a NaN-poisoned output:
    every element written, the skipped blocks 0, the rest within SPEC §3 of
    the oracle on the indices the clamp rule leaves valid; the same bits
    twice."""
    tag = ("raw-ranges-attn", H, D, S) + ((B, N, T, "far") if far else ())
    rng = np.random.default_rng(seed_of(*tag))
    q = jnp.asarray(rng.standard_normal((B, S, H, D)).astype(np.float32), BF16)
    k = jnp.asarray(rng.standard_normal((B, N, 1, D)).astype(np.float32), BF16)
    idx = adversarial_indices(rng, B, S, T, N, far=far)
    ranges = adversarial_row_ranges(rng, B, S, N, T, far=far)
    masked = np.where(ranges_mask(idx, ranges, N), idx, -1)
    rule = dict(sm_scale=D ** -0.5, k_stride=1, lse_base="2")
    lse = oracle.exact_lse(q, k, masked, causal=False, q_start_index=0, empty_value=0.0, **rule).astype(np.float32)
    q_start = jnp.asarray(rng.integers(-50, 50, (B,)), jnp.int32)
    kernel = functools.partial(attn_dist_cases.poisoned_kernel_call, causal=True, **rule)
    call = jax.jit(lambda q, k, *rest: kernel(q, as_bf16(k), *rest))
    operands = (q, key_operand(k), jnp.asarray(idx), jnp.asarray(lse), q_start, jnp.asarray(ranges))
    got = np.asarray(call(*operands))
    want = oracle.attn_dist_oracle(q, k, masked, lse, causal=False, q_start_index=0, **rule)
    assert not np.isnan(got).any()
    assert np.asarray(call(*operands)).tobytes() == got.tobytes()
    if np.abs(want).max() > 0:
        oracle.assert_within_spec(got, want)
    valid = ranges_mask(idx, ranges, N)[:, None, :, 0, :]
    assert np.all(got[np.broadcast_to(~valid, got.shape)] == 0), "nonzero output on a slot the ranges exclude"
    live = np.clip(ranges[..., 2].astype(np.int64), 0, T)
    for b, s in zip(*np.nonzero(live < T)):
        assert np.all(got[b, :, s, live[b, s]:] == 0)


def check_indexer_kernels_on_raw_row_ranges(deterministic, HI, DI, *, B=2, S=40, N=300, T=200, far=False):
    """The indexer's forward and backward kernels on adversarial row ranges
    (causal=True and q_start replaced by them) into poisoned outputs: the
    forward within SPEC §3.2 of the oracle on the indices the clamp rule
    leaves valid (lse -inf exactly on rows with none), the backward within
    its bound, d index_k exactly 0 on keys no valid slot selects."""
    tag = ("raw-ranges-indexer", HI, DI) + ((B, S, N, T, "far") if far else ())
    rng = np.random.default_rng(seed_of(*tag))
    iq, ik, w, _, tgt, kw = make_indexer_inputs(seed_of(*tag), B=B, S=S, HI=HI, DI=DI, N=N, T=T, dtype=BF16,
                                                zero_rows=0.1)
    idx = adversarial_indices(rng, B, S, T, N, far=far)
    ranges = adversarial_row_ranges(rng, B, S, N, T, far=far)
    valid = ranges_mask(idx, ranges, N)
    masked = np.where(valid, idx, -1)
    scale = kw["scale"]
    q_start = jnp.asarray(rng.integers(-50, 50, (B,)), jnp.int32)
    operands = (iq, key_operand(ik), w, jnp.asarray(idx), tgt, q_start)
    fwd = functools.partial(indexer_cases.poisoned_kernel_call, scale=scale, causal=True, k_stride=1)
    kl, lse = jax.jit(lambda iq, ik, *rest: fwd(iq, as_bf16(ik), *rest))(*operands, jnp.asarray(ranges))
    plain = dict(scale=scale, causal=False, q_start_index=0, k_stride=1)
    oracle.assert_indexer_close(np.asarray(kl), oracle.indexer_kl_oracle(iq, ik, w, masked, tgt, **plain))
    want_lse = oracle.indexer_lse_oracle(iq, ik, w, masked, **plain)
    got_lse = np.asarray(lse)
    assert np.array_equal(np.isinf(got_lse), np.isinf(want_lse))
    finite = np.isfinite(want_lse)
    if finite.any():
        np.testing.assert_allclose(got_lse[finite], want_lse[finite],
                                   atol=2e-3 * max(1.0, np.abs(want_lse[finite]).max()))

    g = jnp.asarray(rng.standard_normal((B, S)), jnp.float32)
    bwd = functools.partial(indexer_cases.poisoned_bwd_call, scale=scale, causal=True, k_stride=1,
                            deterministic=deterministic)
    d_index_q, d_weights, d_index_k = jax.jit(lambda iq, ik, *rest: bwd(iq, as_bf16(ik), *rest))(
        *operands, lse, g, jnp.asarray(ranges))
    assert_bwd_within_bound((d_index_q, d_index_k, d_weights),
                            *oracle.indexer_grads_oracle(iq, ik, w, masked, tgt, g, **plain, magnitudes=True))
    hit = np.zeros((B, N), bool)
    b_, s_, _, t_ = np.nonzero(valid)
    hit[b_, idx[b_, s_, 0, t_]] = True
    assert np.all(np.asarray(d_index_k, np.float32)[~hit] == 0), "d index_k written on a key no valid slot selects"


def check_calls_without_row_ranges():
    """The three main FFI targets take row_ranges as an optional last operand:
    a call with the operand list of before SPEC §6 (as a jax.export blob
    from then holds) gives the same bits as one with empty ranges."""
    rng = np.random.default_rng(seed_of("no-row-ranges"))
    B, S, H, D, N, T = 1, 16, 64, 576, 200, 96
    q = jnp.asarray(rng.standard_normal((B, S, H, D)).astype(np.float32), BF16)
    k = jnp.asarray(rng.standard_normal((B, N, 1, D)).astype(np.float32), BF16)
    idx = jnp.asarray(adversarial_indices(rng, B, S, T, N))
    lse = jnp.asarray(rng.uniform(3, 6, (B, S, H)).astype(np.float32))
    qs = jnp.asarray([150], jnp.int32)
    none = checks.no_row_ranges(B, S)
    attrs = dict(sm_scale=np.float32(0.05), causal=True, k_stride=np.int32(1), lse_base_e=False)
    out = jax.ShapeDtypeStruct((B, 1, S, T), jnp.float32)
    call = jax.ffi.ffi_call(attn_contract.FFI_TARGET, out)
    old = jax.jit(lambda *a: call(*a, **attrs))(q, k, idx, lse, qs)
    new = jax.jit(lambda *a: call(*a, **attrs))(q, k, idx, lse, qs, none)
    assert np.asarray(old).tobytes() == np.asarray(new).tobytes() and np.abs(np.asarray(old)).max() > 0

    iq, ik, w, _, tgt, kw = make_indexer_inputs(seed_of("no-row-ranges-ix"), B=B, S=S, HI=64, DI=128, N=N, T=T,
                                                dtype=BF16)
    attrs = dict(scale=np.float32(kw["scale"]), causal=True, k_stride=np.int32(1))
    row = jax.ShapeDtypeStruct((B, S), jnp.float32)
    fwd = jax.ffi.ffi_call(indexer_contract.FWD_FFI_TARGET, (row, row))
    operands = (iq, ik, w.astype(jnp.float32), idx, tgt, qs)
    kl_old, lse_old = jax.jit(lambda *a: fwd(*a, **attrs))(*operands)
    kl_new, lse_new = jax.jit(lambda *a: fwd(*a, **attrs))(*operands, none)
    assert np.asarray(kl_old).tobytes() == np.asarray(kl_new).tobytes()
    assert np.asarray(lse_old).tobytes() == np.asarray(lse_new).tobytes()

    outs = (jax.ShapeDtypeStruct(iq.shape, jnp.bfloat16), jax.ShapeDtypeStruct(w.shape, jnp.float32),
            jax.ShapeDtypeStruct(ik.shape, jnp.float32), jax.ShapeDtypeStruct((0,), jnp.uint8))
    bwd = jax.ffi.ffi_call(indexer_contract.BWD_FFI_TARGET, outs)
    g = jnp.ones((B, S), jnp.float32)
    grads_old = jax.jit(lambda *a: bwd(*a, deterministic=False, **attrs))(*operands, lse_old, g)
    grads_new = jax.jit(lambda *a: bwd(*a, deterministic=False, **attrs))(*operands, lse_old, g, none)
    for a, b in zip(grads_old[:2], grads_new[:2]):  # d index_q, d weights: one writer each
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
    np.testing.assert_allclose(np.asarray(grads_old[2]), np.asarray(grads_new[2]), rtol=1e-5,
                               atol=1e-6 * float(np.abs(np.asarray(grads_old[2])).max()))
