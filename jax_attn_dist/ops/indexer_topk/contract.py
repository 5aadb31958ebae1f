"""indexer_topk's input contract (SPEC §9) and its CUDA kernel's coverage.

Every shape, dtype and parameter check of ``indexer_topk`` lives here (built
from the shared ``_core.checks``). Errors are ``TypeError`` or
``ValueError``, each message starting with ``indexer_topk``, naming the
argument and giving the expected and the actual value.
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any, Optional, Tuple

import jax.numpy as jnp
import numpy as np

from ..._core import checks
from .variants import KERNEL_DTYPES, KERNEL_VARIANTS

#: XLA FFI target of the selection kernel (csrc/indexer_topk/).
FFI_TARGET = "jax_attn_dist_indexer_topk"

#: ``index_q``/``index_k`` dtypes the jnp path accepts; float8_e4m3fn needs
#: ``index_k_scale``.
DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32), jnp.dtype(jnp.float8_e4m3fn))
FP8_DTYPES = (jnp.dtype(jnp.float8_e4m3fn),)

#: ``weights`` dtypes accepted (used in float32), as indexer_kl's.
WEIGHT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


@dataclasses.dataclass(frozen=True)
class Problem:
    """The static description of one ``indexer_topk`` call in canonical
    (batched) terms; ``batched`` says whether the caller's arrays carry B.
    ``T`` is ``topk`` (None where only the operands are known, as in a
    lowering rule): the packing helpers read it as the slot count."""

    batched: bool
    B: int
    S: int
    HI: int
    DI: int
    N: int
    dtype: Any          # numpy dtype of index_q and index_k
    weights_dtype: Any  # numpy dtype of weights
    has_scale: bool     # index_k_scale was given
    T: Optional[int] = None

    @property
    def out_shape(self) -> Tuple[int, ...]:
        """The shape the caller gets back: ``[B?, S, 1, topk]``."""
        return ((self.B,) if self.batched else ()) + (self.S, 1, self.T)

    @property
    def is_empty(self) -> bool:
        """No row (B = 0 or S = 0), or no key (N = 0: every slot is -1)."""
        return self.B == 0 or self.S == 0 or self.N == 0


def check_dtypes(who: str, index_q, index_k):
    dt, kdt = jnp.dtype(index_q.dtype), jnp.dtype(index_k.dtype)
    if dt != kdt:
        raise TypeError(f"{who}: `index_q` and `index_k` must have the same dtype (bfloat16; float16, float32 and "
                        f"float8_e4m3fn accepted on the XLA path), got `index_q` {checks.dtype_name(dt)} and "
                        f"`index_k` {checks.dtype_name(kdt)}")
    if dt not in DTYPES:
        raise TypeError(f"{who}: `index_q` and `index_k` must have dtype bfloat16 (float16, float32 and "
                        f"float8_e4m3fn accepted on the XLA path), got {checks.dtype_name(dt)}")
    return dt


def check_problem(index_q, index_k, weights, index_k_scale=None, who: str = "indexer_topk") -> Problem:
    """Validates ``indexer_topk``'s array arguments (with or without the
    leading batch dimension) and returns the problem's sizes."""
    named = [("index_q", index_q), ("index_k", index_k), ("weights", weights)]
    if index_k_scale is not None:
        named.append(("index_k_scale", index_k_scale))
    for name, x in named:
        checks.check_array(name, x, who)
    others = [("index_k", index_k, "N, DI", 2), ("weights", weights, "S, HI", 2)]
    if index_k_scale is not None:
        others.append(("index_k_scale", index_k_scale, "N", 1))
    batched, B, (S, HI, DI), lead = checks.check_ranks(who, "index_q", index_q, "S, HI, DI", others)

    qdt = check_dtypes(who, index_q, index_k)
    wdt = jnp.dtype(weights.dtype)
    if wdt not in WEIGHT_DTYPES:
        raise TypeError(f"{who}: `weights` must have dtype float32 or bfloat16, got {checks.dtype_name(wdt)}")
    if qdt in FP8_DTYPES and index_k_scale is None:
        raise TypeError(f"{who}: `index_k_scale` is required when `index_q`/`index_k` are {checks.dtype_name(qdt)} "
                        "(float32 [B?, N]: each key's dequantisation scale; fold the query scales into "
                        "`weights`)")
    if index_k_scale is not None and jnp.dtype(index_k_scale.dtype) != jnp.dtype(jnp.float32):
        raise TypeError(f"{who}: `index_k_scale` must have dtype float32, got "
                        f"{checks.dtype_name(index_k_scale.dtype)}")

    if HI < 1 or DI < 1:
        raise ValueError(f"{who}: `index_q` must have at least one head and one feature (HI, DI >= 1), got shape "
                         f"{checks.fmt_shape(index_q.shape)}")
    kshape = tuple(int(d) for d in index_k.shape)
    N = kshape[-2]
    lead_sizes = (B,) if batched else ()
    if kshape != lead_sizes + (N, DI):
        raise ValueError(f"{who}: `index_k` must have shape [{lead}N, DI] with DI = {DI} (from `index_q`)"
                         + (f" and B = {B}" if batched else "") + f", got {checks.fmt_shape(kshape)}")
    want_w = lead_sizes + (S, HI)
    if tuple(int(d) for d in weights.shape) != want_w:
        raise ValueError(f"{who}: `weights` must have shape [{lead}S, HI] = {checks.fmt_shape(want_w)}, got "
                         f"{checks.fmt_shape(weights.shape)}")
    if index_k_scale is not None:
        want_s = lead_sizes + (N,)
        if tuple(int(d) for d in index_k_scale.shape) != want_s:
            raise ValueError(f"{who}: `index_k_scale` must have shape [{lead}N] = {checks.fmt_shape(want_s)} (N"
                             + (", B" if batched else "") + f" from `index_k`), got "
                             f"{checks.fmt_shape(index_k_scale.shape)}")
    return Problem(batched=batched, B=B, S=S, HI=HI, DI=DI, N=N, dtype=qdt, weights_dtype=wdt,
                   has_scale=index_k_scale is not None)


def check_topk(topk: Any, who: str = "indexer_topk") -> int:
    if isinstance(topk, (bool, np.bool_)) or not isinstance(topk, (numbers.Integral, np.integer)):
        raise TypeError(f"{who}: `topk` must be a Python int >= 1 (static), got {type(topk).__name__}: {topk!r}")
    value = int(topk)
    if not (1 <= value <= checks.INT32_MAX):
        raise ValueError(f"{who}: `topk` must be an int >= 1 and at most 2^31 - 1 (the number of keys kept per "
                         f"query row), got {value}")
    return value


def check_canonical(index_q, index_k, weights, index_k_scale, q_start, row_ranges,
                    who: str = "indexer_topk") -> Problem:
    """Validates the operands of the indexer_topk primitives: index_q
    [B,S,HI,DI], index_k [B,N,DI], weights [B,S,HI], index_k_scale [B,N] f32,
    q_start [B] int32, row_ranges [B,S,3|0] int32."""
    if index_q.ndim != 4:
        raise ValueError(f"{who} primitive: `index_q` must be canonical [B, S, HI, DI], got "
                         f"{checks.fmt_shape(index_q.shape)}")
    problem = check_problem(index_q, index_k, weights, index_k_scale, who)
    checks.check_rule_operands(q_start, row_ranges, problem.B, problem.S, who)
    return problem


@dataclasses.dataclass(frozen=True)
class Params:
    """``indexer_topk``'s static parameters, checked."""

    topk: int
    scale: float
    causal: bool
    k_stride: int

    def as_dict(self):
        return dataclasses.asdict(self)


def check_params(*, topk, scale, causal, k_stride, who: str = "indexer_topk") -> Params:
    return Params(
        topk=check_topk(topk, who),
        scale=checks.check_sm_scale(scale, who, name="scale"),
        causal=checks.check_causal(causal, who),
        k_stride=checks.check_k_stride(k_stride, who),
    )


def kernel_supports(problem: Problem, *, topk: Optional[int] = None) -> Tuple[bool, str]:
    """Whether the indexer_topk CUDA kernel serves this problem, and if not,
    why: index_q/index_k of a dtype in ``KERNEL_DTYPES``, a DI of
    ``KERNEL_VARIANTS`` with at most that entry's HI heads; S, N, B * S below
    2^31 and topk at most 2^30; batch, packed rows, traced q_start; weights
    float32 or bfloat16. ``topk``: the slot count where ``problem.T`` is not
    known (a lowering rule's problem is built from the operands alone)."""
    if topk is not None:
        problem = dataclasses.replace(problem, T=topk)
    if checks.dtype_name(problem.dtype) not in KERNEL_DTYPES:
        return False, (f"the indexer_topk CUDA kernel takes index_q/index_k of dtype {' or '.join(KERNEL_DTYPES)}, "
                       f"got {checks.dtype_name(problem.dtype)}")
    # The launcher takes the variant with the fewest heads that holds HI (csrc/indexer_topk/variants.h).
    if not any(d == problem.DI and 1 <= problem.HI <= h for d, h in KERNEL_VARIANTS):
        built = ", ".join(f"(DI = {d}, HI <= {h})" for d, h in KERNEL_VARIANTS)
        return False, (f"the indexer_topk CUDA kernel is built for {built}, got DI = {problem.DI}, "
                       f"HI = {problem.HI}")
    too_large = checks.kernel_size_reason(S=problem.S, N=problem.N, T=problem.T, rows=problem.B * problem.S,
                                          rows_what="B * S")
    if too_large:
        return False, too_large
    return True, "supported"
