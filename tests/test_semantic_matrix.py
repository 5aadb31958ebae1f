"""The kernel issue's semantic matrix through the jnp path (CPU, in CI).

The same 64 configurations the GPU sweep gives the kernel (kernel_cases.py):
T in {1, 63, 64, 65, 127, 200, 2048, 2049}, H in {1, 16, 32, 64, 96, 128},
D in {512, 576}, B in {none, 1, 3}, causal or not, traced and per-batch
q_start_index, k_stride in {1, 4}, both lse bases, 0/30/100% invalid slots
(INT32_MIN, -1, N, INT32_MAX, causally invisible keys, duplicates) and
+inf/-inf/NaN lse entries.
"""

import jax
import numpy as np
import pytest

import jax_attn_dist
from jax_attn_dist import oracle
from kernel_cases import make_case_inputs, sweep_cases

CASES = sweep_cases(64)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_jnp_path_matches_float64(case):
    (q, k, idx, lse, q_start), kw = make_case_inputs(case)
    if case.B is None:
        q, k, idx, lse, q_start = q[0], k[0], idx[0], lse[0], q_start[0]
    elif not case.per_batch_q_start:
        q_start = q_start[0]
    kw = {key: v for key, v in kw.items() if key != "q_start_index"}
    f = jax.jit(lambda q, k, i, l, s: jax_attn_dist.attn_dist(q, k, i, l, q_start_index=s,
                                                              implementation="xla", **kw))
    out = np.asarray(f(q, k, idx, lse, q_start))  # q_start traced
    ref = oracle.attn_dist_oracle(q, k, idx, lse, q_start_index=q_start, **kw)
    assert out.shape == ref.shape
    assert np.isfinite(out).all()
    valid = oracle.valid_mask(idx if case.B is not None else idx[None], case.N, causal=case.causal,
                              q_start_index=np.atleast_1d(q_start), k_stride=case.k_stride)
    out_b = out if case.B is not None else out[None]
    invalid = np.broadcast_to(~valid[:, None, :, 0, :], out_b.shape)
    assert (out_b[invalid] == 0).all()
    if np.abs(ref).max() > 0:
        oracle.assert_within_spec(out, ref)
