"""Gradients of attn_dist (custom VJP, jnp backward) against jax.grad of a
plain, unfused jnp implementation of SPEC §2 (grad_util.plain_attn_dist; CPU,
XLA path) and against the float64 formulas (grad_util.attn_dist_grads_f64),
within the float32 rounding bound of each gradient element."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grad_util import assert_grads_within_float32_bounds, plain_attn_dist, square_loss_cotangent
from inputs import make_inputs, seed_of
from jax_attn_dist import attn_dist
from jax_attn_dist.ops.attn_dist import contract as attn_contract
from jax_attn_dist._core import checks
from jax_attn_dist.ops.attn_dist import backward
from jaxpr_util import iter_eqns

BF16, F16, F32 = jnp.bfloat16, jnp.float16, jnp.float32


def poison_lse(lse, rng, fraction=0.15):
    """Sets a fraction of lse entries to +inf, -inf or NaN."""
    lse = np.array(lse)
    mask = rng.random(lse.shape) < fraction
    vals = rng.choice(np.array([np.inf, -np.inf, np.nan], np.float32), lse.shape)
    lse[mask] = vals[mask]
    return jnp.asarray(lse)


def vjps(q, k, idx, lse, kw, cot):
    """(ours, plain): the cotangents of q, k, lse for output cotangent ``cot``.
    Ours runs on the inputs as given; plain on their exact float32 values."""
    kw = dict(kw)
    qs = kw.pop("q_start_index")

    def ours(q, k, l, s):
        return attn_dist(q, k, idx, l, q_start_index=s, implementation="xla", **kw)

    def plain(q, k, l, s):
        return plain_attn_dist(q, k, idx, l, q_start_index=s, **kw)

    qs = jnp.asarray(qs, jnp.int32)
    got = jax.jit(lambda q, k, l, s, c: jax.vjp(lambda q, k, l: ours(q, k, l, s), q, k, l)[1](c))(q, k, lse, qs, cot)
    want = jax.jit(lambda q, k, l, s, c: jax.vjp(lambda q, k, l: plain(q, k, l, s), q, k, l)[1](c))(
        q.astype(F32), k.astype(F32), lse, qs, cot)
    return got, want


CASES = [
    # dtype, B, H, HK, causal, k_stride, lse_base, q_start kind
    (F32, None, 3, 1, True, 1, "2", "int"),
    (BF16, None, 3, 1, True, 1, "e", "int"),
    (F32, 2, 72, 1, True, 2, "e", "batch"),
    (BF16, 2, 72, 1, True, 2, "2", "batch"),
    (F32, 2, 8, 2, False, 1, "2", "int"),
    (BF16, None, 12, 4, True, 3, "e", "int"),
    (F16, 2, 6, 2, True, 1, "2", "batch"),
]


def _id(c):
    dt, B, H, HK, causal, ks, base, qs = c
    return f"{jnp.dtype(dt).name}-B{B}-H{H}-HK{HK}-{'causal' if causal else 'full'}-ks{ks}-base{base}-{qs}"


@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_grad_matches_plain_jax_grad(case):
    """Invalid indices (negative, >= N), many duplicates (T > N), causal
    masking with a random q_start, non-finite lse (+inf, -inf, NaN) and noisy
    lse; a random output cotangent."""
    dtype, B, H, HK, causal, ks, base, qs = case
    seed = seed_of("grad", _id(case))
    rng = np.random.default_rng(seed)
    q, k, idx, lse, kw = make_inputs(
        seed, B=B, S=9, H=H, D=16, N=7, T=11, HK=HK, dtype=dtype, causal=causal, k_stride=ks,
        lse_base=base, q_start_index="batch" if qs == "batch" else None, lse_noise=0.5,
    )
    lse = poison_lse(lse, rng)
    out_shape = jax.eval_shape(lambda: plain_attn_dist(q, k, idx, lse, **kw)).shape
    cot = jnp.asarray(rng.standard_normal(out_shape), F32)
    (dq, dk, dlse), (dq_p, dk_p, dlse_p) = vjps(q, k, idx, lse, kw, cot)

    assert dq.dtype == dtype and dk.dtype == dtype and dlse.dtype == F32
    assert_grads_within_float32_bounds((dq, dk, dlse), (dq_p, dk_p, dlse_p), q, k, idx, lse, kw, cot)

    # no gradient at all where p is 0: non-finite lse, and rows/heads whose slots are all invalid
    dlse = np.asarray(dlse)
    assert np.all(dlse[~np.isfinite(np.asarray(lse))] == 0.0)
    assert np.all(np.isfinite(np.asarray(dq, np.float32))) and np.all(np.isfinite(np.asarray(dk, np.float32)))


def test_duplicates_accumulate_and_invalid_contribute_nothing():
    """Every slot points at key 2 (plus invalid ones): dk[2] receives every
    valid slot's contribution, every other key row gets exactly 0."""
    seed = seed_of("grad-dup")
    rng = np.random.default_rng(seed)
    q, k, idx, lse, kw = make_inputs(seed, S=6, H=4, D=8, N=5, T=7, dtype=F32, causal=False, lse_base="e")
    idx = np.full(idx.shape, 2, np.int32)
    idx[:, :, 1] = -1
    idx[:, :, 4] = 5  # == N: out of range
    idx = jnp.asarray(idx)
    cot = jnp.asarray(rng.standard_normal((1, 6, 7)), F32)
    (dq, dk, dlse), (dq_p, dk_p, dlse_p) = vjps(q, k, idx, lse, kw, cot)
    assert np.all(np.asarray(dk)[[0, 1, 3, 4]] == 0.0)
    assert_grads_within_float32_bounds((dq, dk, dlse), (dq_p, dk_p, dlse_p), q, k, idx, lse, kw, cot)


def test_non_finite_cotangent_on_zero_slots_is_ignored():
    """Slots where p is 0 (invalid, or lse not finite) contribute nothing even
    when their cotangent is inf/NaN (e.g. the gradient of log(out) at 0)."""
    seed = seed_of("grad-cot")
    rng = np.random.default_rng(seed)
    q, k, idx, lse, kw = make_inputs(seed, B=2, S=6, H=3, D=8, N=5, T=6, dtype=F32, q_start_index="batch")
    lse = poison_lse(lse, rng, fraction=0.3)
    qs = kw.pop("q_start_index")
    f = lambda q, k, l: attn_dist(q, k, idx, l, q_start_index=qs, **kw)
    out = jax.jit(f)(q, k, lse)
    vjp = jax.jit(lambda c: jax.vjp(f, q, k, lse)[1](c))
    zero = np.asarray(out) == 0.0
    assert zero.any() and (~zero).any()
    cot = rng.standard_normal(out.shape).astype(np.float32)
    clean = vjp(jnp.asarray(np.where(zero, 0.0, cot)))
    cot[zero] = rng.choice(np.array([np.inf, -np.inf, np.nan], np.float32), int(zero.sum()))
    dirty = vjp(jnp.asarray(cot))
    for a, b in zip(dirty, clean):
        assert np.all(np.isfinite(a))
        if jax.default_backend() == "cpu":
            np.testing.assert_array_equal(a, b)
        else:  # scatter-add order may vary on a GPU
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6 * float(jnp.abs(b).max()))


def test_lse_base_2_scales_dlse_by_ln2():
    """The same probabilities given in base e and in base 2: dq/dk agree and
    dlse_2 = ln 2 * dlse_e."""
    seed = seed_of("grad-base")
    rng = np.random.default_rng(seed)
    q, k, idx, lse_e, kw = make_inputs(seed, S=5, H=3, D=8, N=6, T=4, dtype=F32, causal=False, lse_base="e")
    lse_2 = jnp.asarray(np.asarray(lse_e, np.float64) / math.log(2.0), F32)
    cot = jnp.asarray(rng.standard_normal((1, 5, 4)), F32)

    def grads(lse, base):
        f = lambda q, k, l: attn_dist(q, k, idx, l, **dict(kw, lse_base=base))
        return jax.jit(lambda q, k, l, c: jax.vjp(f, q, k, l)[1](c))(q, k, lse, cot)

    dq_e, dk_e, dl_e = grads(lse_e, "e")
    dq_2, dk_2, dl_2 = grads(lse_2, "2")
    np.testing.assert_allclose(dq_2, dq_e, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(dk_2, dk_e, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(dl_2, math.log(2.0) * np.asarray(dl_e), rtol=1e-5, atol=1e-7)


def test_chunked_backward_equals_single_chunk():
    """The backward's chunk loop (overlapping last chunk, dk accumulated
    across chunks) gives the single-chunk result, across batch boundaries."""
    seed = seed_of("grad-chunks")
    rng = np.random.default_rng(seed)
    q, k, idx, lse, kw = make_inputs(seed, B=3, S=7, H=5, D=8, N=6, T=9, dtype=F32, q_start_index="batch", lse_noise=0.3)
    qs = jnp.asarray(kw.pop("q_start_index"), jnp.int32)
    g = jnp.asarray(rng.standard_normal((3, 1, 7, 9)), F32)
    params = dict(sm_scale=kw["sm_scale"], causal=kw["causal"], k_stride=kw["k_stride"], lse_base=kw["lse_base"])
    none = checks.no_row_ranges(3, 7)
    whole = jax.jit(lambda *a: backward.attn_dist_bwd_canonical(*a, **params))(q, k, idx, lse, qs, none, g)
    for chunk in (4, 5, 8):  # 21 rows: 6 chunks with an overlap; 5 chunks overlapping; 3 chunks
        part = jax.jit(lambda *a: backward.attn_dist_bwd_canonical(*a, chunk=chunk, **params))(q, k, idx, lse, qs,
                                                                                               none, g)
        for a, b, name in zip(part, whole, ("dq", "dk", "dlse")):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6 * float(jnp.abs(b).max()), err_msg=f"{name} chunk={chunk}")


def test_public_grad_through_chunk_loop(monkeypatch):
    """A backward budget small enough that the public gradient runs several
    chunks still matches the plain jax.grad."""
    monkeypatch.setattr(backward, "CHUNK_BYTES", 1)
    seed = seed_of("grad-public-chunks")
    rng = np.random.default_rng(seed)
    q, k, idx, lse, kw = make_inputs(seed, B=2, S=5, H=4, D=8, N=6, T=5, dtype=BF16, q_start_index="batch", lse_noise=0.3)
    assert backward.backward_chunk_rows(attn_contract.check_canonical(q, k, idx, lse, jnp.zeros(2, jnp.int32),
                                                                 checks.no_row_ranges(2, 5))) == 1
    cot = jnp.asarray(rng.standard_normal((2, 1, 5, 5)), F32)
    (dq, dk, dlse), (dq_p, dk_p, dlse_p) = vjps(q, k, idx, lse, kw, cot)
    assert_grads_within_float32_bounds((dq, dk, dlse), (dq_p, dk_p, dlse_p), q, k, idx, lse, kw, cot)


def test_integer_operands_get_no_gradient():
    seed = seed_of("grad-int")
    q, k, idx, lse, kw = make_inputs(seed, B=2, S=4, H=2, D=8, N=5, T=3, dtype=F32, q_start_index="batch")
    qs = kw.pop("q_start_index")
    f = lambda q, i, s: attn_dist(q, k, i, lse, q_start_index=s, **kw).sum()
    dq, di, ds = jax.jit(jax.grad(f, argnums=(0, 1, 2), allow_int=True))(q, idx, qs)
    assert di.dtype == jax.dtypes.float0 and di.shape == idx.shape
    assert ds.dtype == jax.dtypes.float0 and ds.shape == qs.shape
    assert dq.shape == q.shape


def test_residuals_are_inputs_only():
    """The VJP keeps no [B, S, H, T] tensor: p is recomputed in the backward."""
    seed = seed_of("grad-res")
    q, k, idx, lse, kw = make_inputs(seed, S=8, H=8, D=4, N=10, T=64, dtype=F32)
    _, vjp_fn = jax.vjp(lambda q, k, l: attn_dist(q, k, idx, l, **kw), q, k, lse)
    sizes = [np.size(x) for x in jax.tree_util.tree_leaves(vjp_fn)]
    assert sizes and max(sizes) <= max(q.size, k.size, idx.size, lse.size) < 8 * 8 * 64


def test_backward_memory_bounded_at_benchmark_size():
    """Traced (not run) at SPEC §4's v32-h128 size: no value in the gradient's
    jaxpr is as large as one [S, H, T] float32 tensor (4 GiB)."""
    B, S, N, H, T, D = 1, 4096, 8192, 128, 2048, 576
    args = (
        jax.ShapeDtypeStruct((B, S, H, D), BF16), jax.ShapeDtypeStruct((B, N, 1, D), BF16),
        jax.ShapeDtypeStruct((B, S, 1, T), jnp.int32), jax.ShapeDtypeStruct((B, S, H), F32),
    )
    f = lambda q, k, i, l: attn_dist(q, k, i, l, lse_base="2", sm_scale=0.1, q_start_index=N - S, implementation="xla").sum()
    jaxpr = jax.make_jaxpr(jax.grad(f, argnums=(0, 1, 3)))(*args)

    def walk(jx):
        for eqn in iter_eqns(jx):
            for v in eqn.outvars:
                aval = v.aval
                if hasattr(aval, "shape"):
                    yield int(np.prod(aval.shape)) * jnp.dtype(aval.dtype).itemsize

    largest = max(walk(jaxpr.jaxpr))
    assert largest < 1 << 30, f"largest intermediate {largest / 2**30:.2f} GiB"


def test_grad_under_scan_checkpoint_vmap_jit():
    """jit(grad) through lax.scan over layers with jax.checkpoint, and
    vmap(grad), equal the plain implementation's gradients."""
    seed = seed_of("grad-scan")
    rng = np.random.default_rng(seed)
    L = 3
    q, k, idx, lse, kw = make_inputs(seed, B=L, S=6, H=4, D=8, N=7, T=5, dtype=F32, q_start_index=2, lse_noise=0.2)
    w = jnp.asarray(rng.standard_normal((L, 1, 6, 5)), F32)

    def loss(fn, q, k, lse):
        def layer(acc, xs):
            q, k, i, l, w = xs
            return acc + jnp.sum(w * fn(q, k, i, l, **kw) ** 2), None

        return jax.lax.scan(jax.checkpoint(layer), 0.0, (q, k, idx, lse, w))[0]

    got = jax.jit(jax.grad(lambda *a: loss(attn_dist, *a), argnums=(0, 1, 2)))(q, k, lse)
    want = jax.jit(jax.grad(lambda *a: loss(plain_attn_dist, *a), argnums=(0, 1, 2)))(q, k, lse)
    for layer in range(L):
        cot, cot_rel = square_loss_cotangent(q[layer], k[layer], idx[layer], lse[layer], kw, w[layer])
        assert_grads_within_float32_bounds([x[layer] for x in got], [x[layer] for x in want], q[layer], k[layer],
                                           idx[layer], lse[layer], kw, cot, cot_rel, label=f"layer {layer} ")

    per_layer = lambda q, k, i, l, w: jax.grad(lambda q, k, l: jnp.sum(w * attn_dist(q, k, i, l, **kw)), argnums=(0, 1, 2))(q, k, l)
    vm = jax.jit(jax.vmap(per_layer))(q, k, idx, lse, w)
    plain_layer = jax.jit(lambda q, k, i, l, w: jax.grad(lambda q, k, l: jnp.sum(w * plain_attn_dist(q, k, i, l, **kw)),
                                                         argnums=(0, 1, 2))(q, k, l))
    for layer in range(L):
        ref = plain_layer(q[layer], k[layer], idx[layer], lse[layer], w[layer])
        assert_grads_within_float32_bounds([x[layer] for x in vm], ref, q[layer], k[layer], idx[layer], lse[layer],
                                           kw, w[layer], label=f"vmap layer {layer} ")


def test_stop_gradient_target_has_no_gradient():
    """The DSA usage: the target is stop_gradient-ed, so nothing flows back."""
    seed = seed_of("grad-stop")
    q, k, idx, lse, kw = make_inputs(seed, S=4, H=2, D=8, N=5, T=3, dtype=F32)
    f = lambda q: jnp.sum(jax.lax.stop_gradient(attn_dist(q, k, idx, lse, **kw)) * q.sum())
    dq = jax.jit(jax.grad(f))(q)
    np.testing.assert_allclose(dq, np.full(q.shape, float(attn_dist(q, k, idx, lse, **kw).sum())), rtol=1e-6)


@pytest.mark.host_devices(8)
@pytest.mark.parametrize("axis_type", ["Auto", "Explicit"])
def test_grad_of_sharded_call(axis_type):
    """jit(grad) with inputs sharded over a 2 x 4 mesh of CPU devices (batch
    and S sharded), with Auto and with Explicit axes (the default of
    jax.make_mesh): the gradients equal the unsharded ones and keep the
    primals' shardings under Explicit axes."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    devices = jax.devices("cpu")
    seed = seed_of("grad-sharded", axis_type)
    q, k, idx, lse, kw = make_inputs(seed, B=2, S=16, H=4, D=8, N=20, T=6, dtype=F32, q_start_index=3, lse_noise=0.2)
    types = (getattr(jax.sharding.AxisType, axis_type),) * 2
    mesh = jax.make_mesh((2, 4), ("b", "sp"), axis_types=types, devices=devices[:8])
    put = lambda x, *spec: jax.device_put(np.asarray(x), NamedSharding(mesh, P(*spec)))
    loss = lambda q, k, l, i: jnp.sum(attn_dist(q, k, i, l, **kw) ** 2)
    got = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(
        put(q, "b", "sp"), put(k, "b"), put(lse, "b", "sp"), put(idx, "b", "sp"))
    want = jax.jit(jax.grad(lambda q, k, l: jnp.sum(plain_attn_dist(q, k, idx, l, **kw) ** 2), argnums=(0, 1, 2)))(
        q, k, lse)
    cot, cot_rel = square_loss_cotangent(q, k, idx, lse, kw)
    assert_grads_within_float32_bounds([np.asarray(a) for a in got], want, q, k, idx, lse, kw, cot, cot_rel)
    if axis_type == "Explicit":
        assert got[0].sharding.spec[:2] == ("b", "sp") and got[1].sharding.spec[:1] == ("b",)
