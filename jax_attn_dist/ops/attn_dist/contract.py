"""attn_dist's input contract (SPEC §2) and its CUDA kernel's coverage.

Every shape, dtype and parameter check of attn_dist lives here (built from
the shared ``_core.checks``). Errors are ``TypeError`` or ``ValueError``,
each message starting with ``attn_dist:`` (or the calling function's name),
naming the argument and giving the expected and the actual value.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Tuple

import jax.numpy as jnp

from ..._core import checks
from .variants import KERNEL_VARIANTS

#: Heads per output group: ``out[g]`` sums heads ``64g .. min(64g+64, H)-1``.
HEADS_PER_GROUP = 64

#: XLA FFI target of the kernel (csrc/attn_dist/ffi.h), and its test-only
#: twin that writes into an aliased, poisoned output (built only with the
#: test targets, csrc/testing/).
FFI_TARGET = "jax_attn_dist_fwd"
FFI_TEST_TARGET = "jax_attn_dist_fwd_into"

#: Feature sizes the CUDA kernel is built for (MLA: 512 latent + 64 rope).
KERNEL_HEAD_DIMS = tuple(sorted({d for d, _ in KERNEL_VARIANTS}))


def num_groups(num_heads: int) -> int:
    """G = ceil(H / 64)."""
    return -(-num_heads // HEADS_PER_GROUP)


@dataclasses.dataclass(frozen=True)
class Problem:
    """The static description of one call, in canonical (batched) terms.

    ``batched`` says whether the caller's arrays carry the leading batch
    dimension; ``B`` is 1 when they do not.
    """

    batched: bool
    B: int
    S: int
    H: int
    D: int
    N: int
    HK: int
    T: int
    dtype: Any  # numpy dtype of q and k

    @property
    def G(self) -> int:
        return num_groups(self.H)

    @property
    def out_shape(self) -> Tuple[int, ...]:
        """The shape the caller gets back: ``[B?, G, S, T]``."""
        if self.batched:
            return (self.B, self.G, self.S, self.T)
        return (self.G, self.S, self.T)

    @property
    def canonical_out_shape(self) -> Tuple[int, int, int, int]:
        return (self.B, self.G, self.S, self.T)

    @property
    def is_empty(self) -> bool:
        """No output element needs computing, or every slot is invalid (N = 0):
        the result is all zeros."""
        return self.B == 0 or self.S == 0 or self.T == 0 or self.N == 0


@dataclasses.dataclass(frozen=True)
class Params:
    """The static parameters, checked and normalised to plain Python values."""

    sm_scale: float
    causal: bool
    k_stride: int
    lse_base: str

    def as_dict(self):
        return dataclasses.asdict(self)


def check_params(*, sm_scale, causal, k_stride, lse_base, who: str = "attn_dist") -> Params:
    return Params(
        sm_scale=checks.check_sm_scale(sm_scale, who),
        causal=checks.check_causal(causal, who),
        k_stride=checks.check_k_stride(k_stride, who),
        lse_base=checks.check_lse_base(lse_base, who),
    )


def check_problem(q, k, indices, lse, who: str = "attn_dist") -> Problem:
    """Validates the four array arguments (user form: with or without the
    leading batch dimension) and returns the problem's sizes."""
    for name, x in (("q", q), ("k", k), ("indices", indices), ("lse", lse)):
        checks.check_array(name, x, who)

    batched, B, (S, H, D), lead = checks.check_ranks(
        who, "q", q, "S, H, D", [("k", k, "N, HK, D", 3), ("indices", indices, "S, HK, T", 3), ("lse", lse, "S, H", 2)])

    # dtypes
    qdt = checks.check_operand_dtypes(who, "q", q, "k", k)
    checks.check_indices_dtype(who, indices)
    if jnp.dtype(lse.dtype) != jnp.dtype(jnp.float32):
        raise TypeError(
            f"{who}: `lse` must have dtype float32, got {checks.dtype_name(lse.dtype)}"
        )

    N, HK, T = checks.check_keys_and_indices(who, q, "k", k, indices, batched, B, S, H, D, lead)
    want_l = ((B,) if batched else ()) + (S, H)
    lshape = tuple(int(d) for d in lse.shape)
    if lshape != want_l:
        raise ValueError(
            f"{who}: `lse` must have shape [{lead}S, H] = {checks.fmt_shape(want_l)}, got "
            f"{checks.fmt_shape(lshape)}"
        )

    return Problem(batched=batched, B=B, S=S, H=H, D=D, N=N, HK=HK, T=T, dtype=qdt)


def check_canonical(q, k, indices, lse, q_start, row_ranges, who: str = "attn_dist") -> Problem:
    """Validates the operands of the logical primitive: q [B,S,H,D],
    k [B,N,HK,D], indices [B,S,HK,T] int32, lse [B,S,H] f32, q_start [B]
    int32, row_ranges [B,S,3|0] int32."""
    if q.ndim != 4:
        raise ValueError(
            f"{who} primitive: `q` must be canonical [B, S, H, D], got {checks.fmt_shape(q.shape)}"
        )
    problem = check_problem(q, k, indices, lse, who)
    checks.check_rule_operands(q_start, row_ranges, problem.B, problem.S, who)
    return problem


def kernel_supports(problem: Problem) -> Tuple[bool, str]:
    """Whether the CUDA kernel serves this problem, and if not, why.

    The kernel serves bfloat16 q/k, HK = 1 (MLA's MQA form), D in {512, 576},
    any H >= 1 and the batch natively, within the launch limits the kernel
    counts in int32 (``checks.kernel_size_reason``: S, N and B * S * G below
    2^31, T at most 2^30). Empty problems (B, S, T
    or N zero) never reach the kernel: ``attn_dist`` returns zeros for them.
    """
    if problem.dtype != jnp.dtype(jnp.bfloat16):
        return False, f"the CUDA kernel takes bfloat16 q/k, got {checks.dtype_name(problem.dtype)}"
    if problem.HK != 1:
        return False, f"the CUDA kernel takes one kv head (HK = 1), got HK = {problem.HK}"
    if problem.D not in KERNEL_HEAD_DIMS:
        return False, (
            f"the CUDA kernel takes head dim D in {list(KERNEL_HEAD_DIMS)}, got D = {problem.D}"
        )
    too_large = checks.kernel_size_reason(S=problem.S, N=problem.N, T=problem.T,
                                          rows=problem.B * problem.S * problem.G, rows_what="B * S * G")
    if too_large:
        return False, too_large
    return True, "supported"
