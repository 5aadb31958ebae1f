"""The indexer's input contract (SPEC §5) and its CUDA kernels' coverage.

Every shape, dtype and parameter check of ``indexer_kl`` lives here (built
from the shared ``_core.checks``); ``indexer_loss`` adds the attn_dist
contract for its other half. Errors are ``TypeError`` or ``ValueError``,
each message starting with the calling function's name, naming the argument
and giving the expected and the actual value.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Tuple

import jax.numpy as jnp
import numpy as np

from ..._core import checks
from ..._core.chunks import ScoreProblem
from .variants import BWD_KERNEL_VARIANTS, FWD_KERNEL_VARIANTS

#: XLA FFI targets of the forward and backward kernels (csrc/indexer/ffi.h),
#: and their test-only twins that write into aliased, poisoned outputs
#: (built only with the test targets, csrc/testing/).
FWD_FFI_TARGET = "jax_attn_dist_indexer_fwd"
FWD_FFI_TEST_TARGET = "jax_attn_dist_indexer_fwd_into"
BWD_FFI_TARGET = "jax_attn_dist_indexer_bwd"
BWD_FFI_TEST_TARGET = "jax_attn_dist_indexer_bwd_into"
#: The deterministic backward of an S-sharded call, in two kernel calls
#: around the all-reduces (``sharded_fixed_point.py``): the rows' bound,
#: then the gradients with the shard's d index_k sums as fixed-point limbs.
BWD_BOUND_FFI_TARGET = "jax_attn_dist_indexer_bwd_bound"
BWD_FIXED_FFI_TARGET = "jax_attn_dist_indexer_bwd_fixed"

#: ``weights`` dtypes ``indexer_kl`` accepts (used in float32).
WEIGHT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))

#: Indexer head dims DI the indexer CUDA kernel is built for.
KERNEL_HEAD_DIMS = tuple(sorted({v[0] for v in FWD_KERNEL_VARIANTS}))

#: The most indexer heads HI the indexer CUDA kernel serves (4 tiles of 64).
KERNEL_MAX_HEADS = max(tile * tiles for _, tile, tiles in FWD_KERNEL_VARIANTS)

#: The most indexer heads HI the backward kernel serves (one tile: its d index_q
#: accumulators for more heads would not fit the registers).
BWD_KERNEL_MAX_HEADS = max(tile for _, tile, _ in BWD_KERNEL_VARIANTS)


@dataclasses.dataclass(frozen=True)
class Problem:
    """The static description of one ``indexer_kl`` call, canonical (batched)
    terms; ``batched`` says whether the caller's arrays carry B."""

    batched: bool
    B: int
    S: int
    HI: int
    DI: int
    N: int
    T: int
    dtype: Any          # numpy dtype of index_q and index_k
    weights_dtype: Any  # numpy dtype of weights

    @property
    def out_shape(self) -> Tuple[int, ...]:
        """The shape the caller gets back: ``[B?, S]``."""
        return (self.B, self.S) if self.batched else (self.S,)

    @property
    def canonical_out_shape(self) -> Tuple[int, int]:
        return (self.B, self.S)

    @property
    def is_empty(self) -> bool:
        """No row, or no slot can be valid (T = 0 or N = 0): all zeros."""
        return self.B == 0 or self.S == 0 or self.T == 0 or self.N == 0

    @property
    def scores(self) -> ScoreProblem:
        """The sizes of the scores (q = index_q, k = index_k with one key
        head) for the shared jnp chunk code."""
        return ScoreProblem(B=self.B, S=self.S, H=self.HI, D=self.DI, N=self.N, HK=1, T=self.T, dtype=self.dtype)


def check_problem(index_q, index_k, weights, indices, target, who: str = "indexer_kl") -> Problem:
    """Validates ``indexer_kl``'s array arguments (with or without the leading
    batch dimension) and returns the problem's sizes."""
    for name, x in (("index_q", index_q), ("index_k", index_k), ("weights", weights),
                    ("indices", indices), ("target", target)):
        checks.check_array(name, x, who)
    batched, B, (S, HI, DI), lead = checks.check_ranks(
        who, "index_q", index_q, "S, HI, DI",
        [("index_k", index_k, "N, DI", 2), ("weights", weights, "S, HI", 2), ("indices", indices, "S, 1, T", 3),
         ("target", target, "S, T", 2)])

    qdt = checks.check_operand_dtypes(who, "index_q", index_q, "index_k", index_k)
    wdt = jnp.dtype(weights.dtype)
    if wdt not in WEIGHT_DTYPES:
        raise TypeError(f"{who}: `weights` must have dtype float32 or bfloat16, got {checks.dtype_name(wdt)}")
    checks.check_indices_dtype(who, indices)
    if jnp.dtype(target.dtype) != jnp.dtype(jnp.float32):
        raise TypeError(f"{who}: `target` must have dtype float32, got {checks.dtype_name(target.dtype)}")

    if HI < 1 or DI < 1:
        raise ValueError(
            f"{who}: `index_q` must have at least one head and one feature (HI, DI >= 1), got shape "
            f"{checks.fmt_shape(index_q.shape)}"
        )
    kshape = tuple(int(d) for d in index_k.shape)
    N = kshape[-2]
    want_k = ((B,) if batched else ()) + (N, DI)
    if kshape != want_k:
        raise ValueError(
            f"{who}: `index_k` must have shape [{lead}N, DI] with DI = {DI} (from `index_q`)"
            + (f" and B = {B}" if batched else "") + f", got {checks.fmt_shape(kshape)}"
        )
    ishape = tuple(int(d) for d in indices.shape)
    T = ishape[-1]
    want_i = ((B,) if batched else ()) + (S, 1, T)
    if ishape != want_i:
        raise ValueError(
            f"{who}: `indices` must have shape [{lead}S, 1, T] = {checks.fmt_shape(want_i)} (S, B from `index_q`; "
            f"one index list per query, as attn_dist takes it), got {checks.fmt_shape(ishape)}"
        )
    for name, x, want, names in (
        ("weights", weights, ((B,) if batched else ()) + (S, HI), "S, HI"),
        ("target", target, ((B,) if batched else ()) + (S, T), "S, T"),
    ):
        shape = tuple(int(d) for d in x.shape)
        if shape != want:
            raise ValueError(f"{who}: `{name}` must have shape [{lead}{names}] = {checks.fmt_shape(want)}, got {checks.fmt_shape(shape)}")
    return Problem(batched=batched, B=B, S=S, HI=HI, DI=DI, N=N, T=T, dtype=qdt, weights_dtype=wdt)


def check_canonical(index_q, index_k, weights, indices, target, q_start, row_ranges,
                    who: str = "indexer_kl") -> Problem:
    """Validates the operands of the indexer primitives: index_q [B,S,HI,DI],
    index_k [B,N,DI], weights [B,S,HI], indices [B,S,1,T] int32,
    target [B,S,T] f32, q_start [B] int32, row_ranges [B,S,3|0] int32."""
    if index_q.ndim != 4:
        raise ValueError(f"{who} primitive: `index_q` must be canonical [B, S, HI, DI], got {checks.fmt_shape(index_q.shape)}")
    problem = check_problem(index_q, index_k, weights, indices, target, who)
    checks.check_rule_operands(q_start, row_ranges, problem.B, problem.S, who)
    return problem


@dataclasses.dataclass(frozen=True)
class Params:
    """``indexer_kl``'s static parameters, checked."""

    scale: float
    causal: bool
    k_stride: int
    deterministic: bool

    def as_dict(self):
        return dataclasses.asdict(self)


def check_params(*, scale, causal, k_stride, deterministic, who: str = "indexer_kl") -> Params:
    return Params(
        scale=checks.check_sm_scale(scale, who, name="scale"),
        causal=checks.check_causal(causal, who),
        k_stride=checks.check_k_stride(k_stride, who),
        deterministic=checks.check_flag(deterministic, "deterministic", who),
    )


def kernel_supports(problem: Problem) -> Tuple[bool, str]:
    """Whether the indexer CUDA kernel serves this problem, and if not, why:
    bfloat16 index_q/index_k, DI in {64, 128}, 1 <= HI <= 256; batch;
    weights float32 or bfloat16; S, N and B * S below 2^31 and T at most
    2^30 (``checks.kernel_size_reason``)."""
    if problem.dtype != jnp.dtype(jnp.bfloat16):
        return False, f"the indexer CUDA kernel takes bfloat16 index_q/index_k, got {checks.dtype_name(problem.dtype)}"
    if problem.DI not in KERNEL_HEAD_DIMS:
        return False, (
            f"the indexer CUDA kernel takes indexer head dim DI in {list(KERNEL_HEAD_DIMS)}, "
            f"got DI = {problem.DI}"
        )
    if problem.HI > KERNEL_MAX_HEADS:
        return False, f"the indexer CUDA kernel takes up to {KERNEL_MAX_HEADS} heads, got HI = {problem.HI}"
    too_large = checks.kernel_size_reason(S=problem.S, N=problem.N, T=problem.T, rows=problem.B * problem.S,
                                          rows_what="B * S")
    if too_large:
        return False, too_large
    return True, "supported"


def bwd_kernel_supports(problem: Problem, *, deterministic: bool = False) -> Tuple[bool, str]:
    """Whether the indexer backward CUDA kernels serve this problem: what the
    forward kernel serves with HI <= 64, in either mode (``deterministic``:
    d index_k by exact 64-bit fixed-point sums, SPEC §5.3)."""
    del deterministic  # both modes have a kernel
    ok, why = kernel_supports(problem)
    if not ok:
        return ok, why
    if problem.HI > BWD_KERNEL_MAX_HEADS:
        return False, (f"the indexer backward kernel takes up to {BWD_KERNEL_MAX_HEADS} heads, "
                       f"got HI = {problem.HI}")
    return True, "supported"


def ffi_attributes(*, scale, causal, k_stride, **unused) -> dict:
    """The attributes every indexer FFI handler takes, with the C++ handlers'
    types (csrc/indexer/ffi.cc): scale f32, causal bool, k_stride int32."""
    return dict(scale=np.float32(scale), causal=bool(causal), k_stride=np.int32(k_stride))


def bwd_workspace_bytes(index_k_shape, *, deterministic: bool) -> int:
    """The backward kernel's workspace in bytes (csrc/ffi.cc), for canonical
    index_k [B, N, DI]: the int64 fixed-point d index_k sums and one int64 word
    for the rows' bound when ``deterministic``, else none."""
    return 8 * (int(np.prod(index_k_shape)) + 1) if deterministic else 0

