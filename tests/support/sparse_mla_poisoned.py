"""sparse_mla's forward and backward kernels writing into NaN-filled outputs
(the test-only FFI twins, csrc/testing/): an element a kernel leaves
unwritten stays NaN and fails the check. Canonical (batched) operands only.
Not a test file."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_attn_dist._core import checks
from jax_attn_dist.ops.sparse_mla import contract
from sparse_mla_cases import check_against_oracle, check_grads

BF16 = jnp.bfloat16


def _q_start(kw, B):
    return jnp.broadcast_to(jnp.asarray(kw["q_start_index"], jnp.int32), (B,))


def forward(q, kv, idx, kw):
    """(out, lse) of the forward twin on batched inputs (q [B,S,H,D], kv
    [B,N,1,D], idx [B,S,1,T], ``kw`` as make_sparse_mla_inputs gives it)."""
    B, S, H, _ = q.shape
    out_types = (jax.ShapeDtypeStruct((B, S, H, contract.KERNEL_D_V), BF16),
                 jax.ShapeDtypeStruct((B, S, H), jnp.float32))

    def call(q, kv, idx, q_start):
        poison = (jnp.full(out_types[0].shape, jnp.nan, BF16), jnp.full(out_types[1].shape, jnp.nan, jnp.float32))
        return jax.ffi.ffi_call(contract.FFI_TEST_TARGET, out_types, input_output_aliases={5: 0, 6: 1})(
            q, kv, idx, q_start, checks.no_row_ranges(B, S), *poison, **contract.ffi_attributes(**kw))

    return jax.jit(call)(q, kv, idx, _q_start(kw, B))


def backward(q, kv, idx, kw, out, lse, dout, dlse, *, deterministic):
    """(dq, dkv float32) of the backward twin, from the forward's out and lse."""
    B, S, _, _ = q.shape
    workspace = contract.bwd_workspace_bytes(q.shape, kv.shape, deterministic=deterministic)
    out_types = (jax.ShapeDtypeStruct(q.shape, BF16), jax.ShapeDtypeStruct(kv.shape, jnp.float32),
                 jax.ShapeDtypeStruct((workspace,), jnp.uint8))

    def call(q, kv, idx, q_start, out, lse, dout, dlse):
        poison = (jnp.full(q.shape, jnp.nan, BF16), jnp.full(kv.shape, jnp.nan, jnp.float32))
        operands = contract.bwd_ffi_operands(q, kv, idx, q_start, checks.no_row_ranges(B, S), out, lse, dout, dlse)
        dq, dkv, _ = jax.ffi.ffi_call(contract.BWD_FFI_TEST_TARGET, out_types, input_output_aliases={9: 0, 10: 1})(
            *operands, *poison, **contract.ffi_attributes(**kw), deterministic=bool(deterministic))
        return dq, dkv

    return jax.jit(call)(q, kv, idx, _q_start(kw, B), out, lse, dout, dlse)


def check_forward_and_backward(q, kv, idx, kw, dout, dlse, *, out_tol, lse_tol, deterministic):
    """Both twins on one problem: out and lse against the float64 oracle (every
    element written: NaN nowhere), then dq and dkv against the float64
    gradients (NaN nowhere, exact zeros where no gradient reaches)."""
    out, lse = forward(q, kv, idx, kw)
    assert not np.isnan(np.asarray(out, np.float32)).any(), "out: elements left unwritten (NaN)"
    assert not np.isnan(np.asarray(lse)).any(), "lse: elements left unwritten (NaN)"
    check_against_oracle(q, kv, idx, kw, out, lse, out_tol=out_tol, lse_tol=lse_tol)
    dq, dkv = backward(q, kv, idx, kw, out, lse, dout, dlse, deterministic=deterministic)
    assert not np.isnan(np.asarray(dq, np.float32)).any(), "dq: elements left unwritten (NaN)"
    assert not np.isnan(np.asarray(dkv)).any(), "dkv: elements left unwritten (NaN)"
    check_grads(q, kv, idx, kw, dout, dlse, dq, dkv.astype(kv.dtype))
