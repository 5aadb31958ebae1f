"""sparse_mla's input contract (SPEC §8) and its CUDA kernel's coverage.

Every shape, dtype and parameter check of sparse_mla lives here (built from
the shared ``_core.checks``). Errors are ``TypeError`` or ``ValueError``,
each message starting with ``sparse_mla`` (or the calling function's name),
naming the argument and giving the expected and the actual value.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Tuple

import jax.numpy as jnp
import numpy as np

from ..._core import checks
from .variants import KERNEL_VARIANTS

#: XLA FFI targets of the forward and backward kernels (csrc/sparse_mla/),
#: and their test-only twins that write into aliased, poisoned outputs
#: (built only with the test targets, csrc/testing/).
FFI_TARGET = "jax_attn_dist_sparse_mla_fwd"
FFI_TEST_TARGET = "jax_attn_dist_sparse_mla_fwd_into"
BWD_FFI_TARGET = "jax_attn_dist_sparse_mla_bwd"
BWD_FFI_TEST_TARGET = "jax_attn_dist_sparse_mla_bwd_into"
#: The deterministic backward of a row-sharded call, in two kernel calls
#: around the all-reduces (``sharded_fixed_point.py``): the row terms and
#: scale words, then dq and the shard's fixed-point sums as limbs.
BWD_BOUND_FFI_TARGET = "jax_attn_dist_sparse_mla_bwd_bound"
BWD_FIXED_FFI_TARGET = "jax_attn_dist_sparse_mla_bwd_fixed"

#: Feature sizes D of q and kv the CUDA kernel is built for (MLA: 512 latent
#: + 64 rope).
KERNEL_HEAD_DIMS = tuple(sorted({d for d, _ in KERNEL_VARIANTS}))

#: The value width the CUDA kernel computes (MLA's latent: the first 512
#: features of kv).
KERNEL_D_V = 512


@dataclasses.dataclass(frozen=True)
class Problem:
    """The static description of one call's arrays, in canonical (batched)
    terms. ``batched`` says whether the caller's arrays carry the leading
    batch dimension; ``B`` is 1 when they do not. (``d_v`` is a parameter,
    see :class:`Params`.)"""

    batched: bool
    B: int
    S: int
    H: int
    D: int
    N: int
    HK: int
    T: int
    dtype: Any  # numpy dtype of q and kv

    def out_shape(self, d_v: int) -> Tuple[int, ...]:
        """The shape of ``out`` the caller gets back: ``[B?, S, H, d_v]``."""
        return ((self.B,) if self.batched else ()) + (self.S, self.H, d_v)

    @property
    def lse_shape(self) -> Tuple[int, ...]:
        """The shape of ``lse`` the caller gets back: ``[B?, S, H]``."""
        return ((self.B,) if self.batched else ()) + (self.S, self.H)

    def canonical_out_shape(self, d_v: int) -> Tuple[int, int, int, int]:
        return (self.B, self.S, self.H, d_v)

    @property
    def canonical_lse_shape(self) -> Tuple[int, int, int]:
        return (self.B, self.S, self.H)

    @property
    def is_empty(self) -> bool:
        """No output element, or no slot can be valid (T = 0 or N = 0): the
        result is ``out = 0`` and ``lse = -inf`` everywhere."""
        return self.B == 0 or self.S == 0 or self.T == 0 or self.N == 0


@dataclasses.dataclass(frozen=True)
class Params:
    """The static parameters, checked and normalised to plain Python values."""

    sm_scale: float
    causal: bool
    k_stride: int
    lse_base: str
    d_v: int
    deterministic: bool

    def as_dict(self):
        return dataclasses.asdict(self)


def check_lse_base(lse_base: Any, who: str) -> str:
    """The base of the *returned* lse. It has a default here ("2"), unlike
    attn_dist's input ``lse_base``; a value other than "2" or "e" is an
    error that says which consumer expects which base."""
    if not isinstance(lse_base, str) or lse_base not in checks.LSE_BASES:
        raise ValueError(
            f"{who}: `lse_base` (the base of the returned lse) must be \"2\" (log2-sum-exp2, the default, as "
            f"TileLang's sparse_mla_fwd writes it) or \"e\" (natural log, as FlashMLA and cuDNN write it); pass "
            f"the same value to attn_dist; got {lse_base!r}"
        )
    return lse_base


def check_d_v(d_v: Any, D: int, who: str) -> int:
    if isinstance(d_v, (bool, np.bool_)) or not isinstance(d_v, (int, np.integer)):
        raise TypeError(f"{who}: `d_v` must be a Python int (static), got {type(d_v).__name__}: {d_v!r}")
    value = int(d_v)
    if not 1 <= value <= D:
        raise ValueError(
            f"{who}: `d_v` (the value width: out = P . kv[:, :d_v]; default {KERNEL_D_V}) must satisfy "
            f"1 <= d_v <= D = {D} (from `q`), got {value}"
        )
    return value


def check_params(problem: Problem, *, sm_scale, causal, k_stride, lse_base, d_v, deterministic,
                 who: str = "sparse_mla") -> Params:
    return Params(
        sm_scale=checks.check_sm_scale(sm_scale, who),
        causal=checks.check_causal(causal, who),
        k_stride=checks.check_k_stride(k_stride, who),
        lse_base=check_lse_base(lse_base, who),
        d_v=check_d_v(d_v, problem.D, who),
        deterministic=checks.check_flag(deterministic, "deterministic", who),
    )


def check_problem(q, kv, indices, who: str = "sparse_mla") -> Problem:
    """Validates the three array arguments (user form: with or without the
    leading batch dimension) and returns the problem's sizes."""
    for name, x in (("q", q), ("kv", kv), ("indices", indices)):
        checks.check_array(name, x, who)

    batched, B, (S, H, D), lead = checks.check_ranks(
        who, "q", q, "S, H, D", [("kv", kv, "N, HK, D", 3), ("indices", indices, "S, HK, T", 3)])

    qdt = checks.check_operand_dtypes(who, "q", q, "kv", kv)
    checks.check_indices_dtype(who, indices)

    N, HK, T = checks.check_keys_and_indices(who, q, "kv", kv, indices, batched, B, S, H, D, lead)
    return Problem(batched=batched, B=B, S=S, H=H, D=D, N=N, HK=HK, T=T, dtype=qdt)


def check_canonical(q, kv, indices, q_start, row_ranges, who: str = "sparse_mla") -> Problem:
    """Validates the operands of the logical primitive: q [B,S,H,D],
    kv [B,N,HK,D], indices [B,S,HK,T] int32, q_start [B] int32,
    row_ranges [B,S,3|0] int32."""
    if q.ndim != 4:
        raise ValueError(
            f"{who} primitive: `q` must be canonical [B, S, H, D], got {checks.fmt_shape(q.shape)}"
        )
    problem = check_problem(q, kv, indices, who)
    checks.check_rule_operands(q_start, row_ranges, problem.B, problem.S, who)
    return problem


def kernel_supports(problem: Problem, *, d_v: int = KERNEL_D_V) -> Tuple[bool, str]:
    """Whether the CUDA kernel serves this problem, and if not, why.

    The kernel serves bfloat16 q/kv, HK = 1 (MLA's MQA form), D in
    {512, 576}, d_v = 512, any H >= 1, the batch, SPEC §6's packed rows and
    a traced q_start natively, within the launch limits the kernels count in
    int32 (``checks.kernel_size_reason``: S, N and B * S * ceil(H / 64)
    below 2^31, T at most 2^30). Empty problems (B, S, T
    or N zero) never reach the kernel: ``sparse_mla`` returns zeros and
    -inf for them.
    """
    if problem.dtype != jnp.dtype(jnp.bfloat16):
        return False, f"the CUDA kernel takes bfloat16 q/kv, got {checks.dtype_name(problem.dtype)}"
    if problem.HK != 1:
        return False, f"the CUDA kernel takes one kv head (HK = 1), got HK = {problem.HK}"
    if problem.D not in KERNEL_HEAD_DIMS:
        return False, f"the CUDA kernel takes head dim D in {list(KERNEL_HEAD_DIMS)}, got D = {problem.D}"
    if d_v != KERNEL_D_V:
        return False, f"the CUDA kernel takes d_v = {KERNEL_D_V}, got d_v = {d_v}"
    too_large = checks.kernel_size_reason(S=problem.S, N=problem.N, T=problem.T,
                                          rows=problem.B * problem.S * -(-problem.H // 64),
                                          rows_what="B * S * ceil(H / 64)")
    if too_large:
        return False, too_large
    return True, "supported"


def bwd_kernel_supports(problem: Problem, *, d_v: int = KERNEL_D_V) -> Tuple[bool, str]:
    """Whether the backward CUDA kernel serves this problem: the forward
    kernel's coverage (:func:`kernel_supports`), in either mode
    (``deterministic``: dkv by exact 64-bit fixed-point sums)."""
    return kernel_supports(problem, d_v=d_v)


def _align(nbytes: int, alignment: int) -> int:
    return -(-nbytes // alignment) * alignment


def bwd_workspace_bytes(q_shape, kv_shape, *, deterministic: bool) -> int:
    """The backward kernel's workspace in bytes, for canonical q [B, S, H, D]
    and kv [B, N, 1, D] (XLA allocates it; the handler allocates nothing).
    Layout, each part starting on a 256-byte boundary: the row terms (one
    float32 per (b, s, h): the row preprocess's rowsum(dout * out) - dlse
    term), then, when ``deterministic``, the fixed-point sums (one int64 per
    element of dkv), then the scale words: per batch element, max |kv| and
    then its rows' largest bound, as float bits (what that element's
    fixed-point scale is chosen from): uint32 [B], then uint32 [B]."""
    B, S, H, _ = (int(d) for d in q_shape)
    _, N, _, D = (int(d) for d in kv_shape)
    size = _align(B * S * H * 4, 256)
    if deterministic:
        size += _align(B * N * D * 8, 256) + _align(B * 2 * 4, 256)
    return size


def ffi_attributes(*, sm_scale, causal, k_stride, lse_base, **unused) -> dict:
    """The attributes every sparse_mla FFI handler takes, with the C++
    handlers' types (csrc/sparse_mla/ffi.cc): sm_scale f32, causal bool,
    k_stride int32, lse_base_e bool."""
    return dict(sm_scale=np.float32(sm_scale), causal=bool(causal), k_stride=np.int32(k_stride),
                lse_base_e=bool(lse_base == "e"))


def bwd_ffi_operands(q, kv, indices, q_start, row_ranges, out, lse, dout, dlse) -> tuple:
    """The backward handlers' nine operands in the dtypes they take: lse and
    dlse float32, dout bf16 (the rest are already the kernel's)."""
    return (q, kv, indices, q_start, row_ranges, out, lse.astype(jnp.float32), dout.astype(jnp.bfloat16),
            dlse.astype(jnp.float32))


def bwd_fixed_workspace_bytes(q_shape, kv_shape) -> int:
    """The sharded deterministic backward's main call's workspace: the
    fixed-point sums (int64 [B, N, D]), then the flag words (uint32 [B]),
    each on a 256-byte boundary."""
    B = int(q_shape[0])
    _, N, _, D = (int(d) for d in kv_shape)
    return _align(B * N * D * 8, 256) + _align(B * 4, 256)
