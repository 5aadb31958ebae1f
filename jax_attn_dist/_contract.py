"""The input contract of ``attn_dist`` (SPEC §2) and the CUDA kernel's coverage.

Every shape, dtype and parameter check lives here, and only here. The checks
look at ``.shape`` and ``.dtype`` only, so they work on concrete arrays, on
``ShapedArray`` avals and on tracers alike (they run at trace time).

Errors are ``TypeError`` (wrong kind or dtype) or ``ValueError`` (wrong shape
or value); each message starts with ``attn_dist:``, names the argument, and
gives the expected and the actual value.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any, Optional, Tuple

import numpy as np
import jax
import jax.numpy as jnp

#: Heads per output group: ``out[g]`` sums heads ``64g .. min(64g+64, H)-1``.
HEADS_PER_GROUP = 64

#: XLA FFI target names of the CUDA extension (csrc/ffi.h defines the same
#: strings; tests check that the extension registers exactly these).
FFI_TARGET = "jax_attn_dist_fwd"                     # attn_dist
FFI_TARGET_POISONED = "jax_attn_dist_fwd_into"       # attn_dist into an aliased (test-poisoned) output
FFI_INDEXER_FWD = "jax_attn_dist_indexer_fwd"        # indexer_kl forward
FFI_INDEXER_FWD_POISONED = "jax_attn_dist_indexer_fwd_into"
FFI_INDEXER_BWD = "jax_attn_dist_indexer_bwd"        # indexer_kl backward
FFI_INDEXER_BWD_POISONED = "jax_attn_dist_indexer_bwd_into"
FFI_TARGETS = (FFI_TARGET, FFI_TARGET_POISONED, FFI_INDEXER_FWD, FFI_INDEXER_FWD_POISONED, FFI_INDEXER_BWD,
               FFI_INDEXER_BWD_POISONED)

#: ``q``/``k`` dtypes the jnp path accepts. The CUDA kernel takes bfloat16 only.
SUPPORTED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))

#: Feature sizes the attn_dist CUDA kernel is built for (MLA: 512 latent + 64 rope).
KERNEL_HEAD_DIMS = (512, 576)

LSE_BASES = ("2", "e")
IMPLEMENTATIONS = (None, "cuda", "xla")

INT32_MIN = -(2**31)
INT32_MAX = 2**31 - 1


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


def _fmt(shape) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def _dtype_name(dt) -> str:
    return jnp.dtype(dt).name


def _check_array(name: str, x: Any, who: str = "attn_dist") -> None:
    if not (hasattr(x, "shape") and hasattr(x, "dtype")):
        raise TypeError(
            f"{who}: `{name}` must be an array (jax or numpy), got {type(x).__name__}"
        )


def _check_ranks(who: str, name: str, x: Any, dims: str, others):
    """The rows operand ``x`` has rank 3 ``[dims]`` or 4 ``[B, dims]``; each
    ``(name, array, dims, unbatched rank)`` of ``others`` must agree. Returns
    ``(batched, B, x's other sizes, "B, " or "")``."""
    if x.ndim not in (3, 4):
        raise ValueError(
            f"{who}: `{name}` must have rank 3 [{dims}] or rank 4 [B, {dims}], "
            f"got rank {x.ndim} with shape {_fmt(x.shape)}"
        )
    batched = x.ndim == 4
    lead = "B, " if batched else ""
    shape = tuple(int(d) for d in x.shape)
    B, sizes = (shape[0], shape[1:]) if batched else (1, shape)
    form = "batched" if batched else "unbatched"
    for other, y, other_dims, rank in others:
        want = rank + int(batched)
        if y.ndim != want:
            raise ValueError(
                f"{who}: `{other}` must have rank {want} [{lead}{other_dims}] because `{name}` "
                f"is {form} (shape {_fmt(x.shape)}), got rank {y.ndim} with shape "
                f"{_fmt(y.shape)}"
            )
    return batched, B, sizes, lead


def _check_operand_dtypes(who: str, name: str, x: Any, partner_name: str, partner: Any):
    """``x`` bfloat16 (or float16/float32 for the jnp path), ``partner`` the same; returns the dtype."""
    dt = jnp.dtype(x.dtype)
    if dt not in SUPPORTED_DTYPES:
        raise TypeError(
            f"{who}: `{name}` must have dtype bfloat16 (float16/float32 accepted on the XLA path), "
            f"got {_dtype_name(dt)}"
        )
    if jnp.dtype(partner.dtype) != dt:
        raise TypeError(
            f"{who}: `{partner_name}` must have the dtype of `{name}` ({_dtype_name(dt)}), got "
            f"{_dtype_name(partner.dtype)}"
        )
    return dt


def _check_indices_dtype(who: str, indices: Any) -> None:
    if jnp.dtype(indices.dtype) != jnp.dtype(jnp.int32):
        raise TypeError(
            f"{who}: `indices` must have dtype int32, got {_dtype_name(indices.dtype)} "
            "(use indices.astype(jnp.int32))"
        )


# ----------------------------------------------------------------------------
# static parameters
# ----------------------------------------------------------------------------


def check_sm_scale(sm_scale: Any, who: str = "attn_dist", name: str = "sm_scale") -> float:
    if isinstance(sm_scale, (bool, np.bool_)) or not isinstance(
        sm_scale, (numbers.Real, np.floating, np.integer)
    ):
        raise TypeError(
            f"{who}: `{name}` must be a Python float (static), got "
            f"{type(sm_scale).__name__}: {sm_scale!r}"
        )
    value = float(sm_scale)
    if not (math.isfinite(value) and value > 0.0):
        raise ValueError(
            f"{who}: `{name}` must be a finite positive float, got {value!r}"
        )
    # It is used in float32, also as sm_scale * log2(e): both must stay finite and > 0.
    with np.errstate(over="ignore", under="ignore"):
        f32 = (np.float32(value), np.float32(value * math.log2(math.e)))
    if not all(np.isfinite(x) and x > 0 for x in f32):
        raise ValueError(
            f"{who}: `{name}` must be representable in float32 (finite and > 0, "
            f"also times log2(e)), got {value!r}"
        )
    return value


def check_causal(causal: Any, who: str = "attn_dist") -> bool:
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(
            f"{who}: `causal` must be a bool, got {type(causal).__name__}: {causal!r}"
        )
    return bool(causal)


def check_k_stride(k_stride: Any, who: str = "attn_dist") -> int:
    if isinstance(k_stride, (bool, np.bool_)) or not isinstance(
        k_stride, (int, np.integer)
    ):
        raise TypeError(
            f"{who}: `k_stride` must be a Python int >= 1 (static), got "
            f"{type(k_stride).__name__}: {k_stride!r}"
        )
    value = int(k_stride)
    if not (1 <= value <= INT32_MAX):
        raise ValueError(f"{who}: `k_stride` must be an int >= 1, got {value}")
    return value


def check_lse_base(lse_base: Any, who: str = "attn_dist") -> str:
    if not isinstance(lse_base, str) or lse_base not in LSE_BASES:
        raise ValueError(
            f"{who}: `lse_base` must be \"2\" (lse = log2 sum exp2, the default) "
            f"or \"e\" (natural log), got {lse_base!r}"
        )
    return lse_base


def check_implementation(implementation: Any, who: str = "attn_dist") -> Optional[str]:
    if implementation is not None and (
        not isinstance(implementation, str) or implementation not in IMPLEMENTATIONS
    ):
        raise ValueError(
            f"{who}: `implementation` must be None (the CUDA kernel where it "
            "applies, else XLA), \"cuda\" or \"xla\", got "
            f"{implementation!r}"
        )
    return implementation


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
        sm_scale=check_sm_scale(sm_scale, who),
        causal=check_causal(causal, who),
        k_stride=check_k_stride(k_stride, who),
        lse_base=check_lse_base(lse_base, who),
    )


# ----------------------------------------------------------------------------
# arrays
# ----------------------------------------------------------------------------


def check_problem(q, k, indices, lse, who: str = "attn_dist") -> Problem:
    """Validates the four array arguments (user form: with or without the
    leading batch dimension) and returns the problem's sizes."""
    for name, x in (("q", q), ("k", k), ("indices", indices), ("lse", lse)):
        _check_array(name, x, who)

    batched, B, (S, H, D), lead = _check_ranks(
        who, "q", q, "S, H, D", [("k", k, "N, HK, D", 3), ("indices", indices, "S, HK, T", 3), ("lse", lse, "S, H", 2)])

    # dtypes
    qdt = _check_operand_dtypes(who, "q", q, "k", k)
    _check_indices_dtype(who, indices)
    if jnp.dtype(lse.dtype) != jnp.dtype(jnp.float32):
        raise TypeError(
            f"{who}: `lse` must have dtype float32, got {_dtype_name(lse.dtype)}"
        )

    # sizes
    kshape = tuple(int(d) for d in k.shape)
    if batched:
        kB, N, HK, kD = kshape
    else:
        N, HK, kD = kshape
        kB = B
    if H < 1:
        raise ValueError(
            f"{who}: `q` must have at least one head (H >= 1), got shape "
            f"{_fmt(q.shape)}"
        )
    if HK < 1 or H % HK != 0:
        raise ValueError(
            f"{who}: the number of kv heads HK of `k` must be >= 1 and divide "
            f"H = {H} (head h uses kv head h // (H // HK)), got HK = {HK} "
            f"(k shape {_fmt(k.shape)})"
        )
    if batched and kB != B:
        raise ValueError(
            f"{who}: `k` must have shape [B, N, HK, D] with B = {B} and D = {D} "
            f"(from `q`), got {_fmt(k.shape)}"
        )
    if kD != D:
        raise ValueError(
            f"{who}: `k` must have shape [{lead}N, HK, D] with D = {D} (from "
            f"`q`), got {_fmt(k.shape)}"
        )

    ishape = tuple(int(d) for d in indices.shape)
    T = ishape[-1]
    want_i = ((B,) if batched else ()) + (S, HK, T)
    if ishape != want_i:
        raise ValueError(
            f"{who}: `indices` must have shape [{lead}S, HK, T] = {_fmt(want_i)} "
            f"(S, B from `q`, HK from `k`), got {_fmt(ishape)}"
        )
    want_l = ((B,) if batched else ()) + (S, H)
    lshape = tuple(int(d) for d in lse.shape)
    if lshape != want_l:
        raise ValueError(
            f"{who}: `lse` must have shape [{lead}S, H] = {_fmt(want_l)}, got "
            f"{_fmt(lshape)}"
        )

    return Problem(batched=batched, B=B, S=S, H=H, D=D, N=N, HK=HK, T=T, dtype=qdt)


def _check_python_int32(name: str, value: Any, who: str) -> int:
    """A Python int (not a bool) that fits int32."""
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{who}: `{name}` must be an int or an int32 array, got a bool")
    value = int(value)
    if not (INT32_MIN <= value <= INT32_MAX):
        raise ValueError(f"{who}: `{name}` must fit in int32, got {value}")
    return value


def _check_int32_values(name: str, x: Any, who: str) -> None:
    """An array (cast to int32 by the caller) of an integer dtype whose values
    fit int32: a wider dtype is accepted only when concrete and in range."""
    dt = jnp.dtype(x.dtype)
    if not jnp.issubdtype(dt, jnp.integer):
        raise TypeError(f"{who}: `{name}` must have an integer dtype (it is cast to int32), got {_dtype_name(dt)}")
    info = jnp.iinfo(dt)
    if info.min < INT32_MIN or info.max > INT32_MAX:  # the cast to int32 could wrap
        if isinstance(x, jax.core.Tracer):
            raise TypeError(f"{who}: a traced `{name}` must be int32 (or narrower), got {_dtype_name(dt)}, "
                            "whose values cannot be range-checked at trace time")
        values = np.asarray(x)
        if values.size and (values.min() < INT32_MIN or values.max() > INT32_MAX):
            raise ValueError(f"{who}: `{name}` must fit in int32, got values in [{values.min()}, {values.max()}]")


def _check_int_array(name: str, x: Any, who: str, what: str):
    """An integer array (cast to int32 by the caller) whose values fit int32:
    ``q_start_index`` and SPEC §6's arrays. Returns the array as given."""
    if isinstance(x, (bool, np.bool_)) or not (hasattr(x, "shape") and hasattr(x, "dtype")):
        raise TypeError(f"{who}: `{name}` must be an int32 array {what}, got {type(x).__name__}: {x!r}")
    _check_int32_values(name, x, who)
    return x


def check_q_start_index(q_start_index: Any, problem, who: str = "attn_dist", num_seqs: Optional[int] = None):
    """Returns either a Python int (checked to fit int32) or the array as given
    (checked: integer dtype, shape [] or, when batched, [B]; with cu_seqlens,
    ``num_seqs`` given, [] or [num_seqs]: one start per sequence). The caller
    casts arrays to int32."""
    if isinstance(q_start_index, (bool, np.bool_, int)):
        return _check_python_int32("q_start_index", q_start_index, who)
    per, length = ("num_seqs", num_seqs) if num_seqs is not None else ("B", problem.B)
    _check_int_array("q_start_index", q_start_index, who, f"of shape [] or [{per}] (or a Python int)")
    shape = tuple(int(d) for d in q_start_index.shape)
    if shape == ():
        return q_start_index
    if num_seqs is None and not problem.batched:
        raise ValueError(
            f"{who}: `q_start_index` must be a scalar (shape []) when the inputs "
            f"are unbatched, got shape {_fmt(shape)}"
        )
    if shape == (length,):
        return q_start_index
    if num_seqs is not None:
        raise ValueError(f"{who}: with cu_seqlens, `q_start_index` must be a Python int or an array of shape [] "
                         f"or [num_seqs] = [{num_seqs}] (one start position per sequence), got {_fmt(shape)}")
    raise ValueError(f"{who}: `q_start_index` must have shape [] or [B] = [{length}], got {_fmt(shape)}")


#: SPEC §6's per-row ranges, the primitives' ``row_ranges`` operand: int32
#: ``[B, S, ROW_RANGE_FIELDS]`` holding, per query row, ``key_begin``,
#: ``key_end`` and ``topk_length``: slot ``j`` selecting key ``i`` is valid iff
#: ``j < topk_length`` and ``key_begin <= i < key_end`` (each clamped: the
#: keys into ``[0, N]``, the length into ``[0, T]``). They replace SPEC §2's
#: causal rule for the call. ``[B, S, 0]`` means none: SPEC §2's rule
#: applies. ``packing.row_ranges`` computes them; csrc/params.h holds the
#: same field count.
ROW_RANGE_FIELDS = 3


def no_row_ranges(B: int, S: int):
    """The ``row_ranges`` operand of a call without SPEC §6 keywords."""
    return jnp.zeros((B, S, 0), jnp.int32)


def _check_rule_operands(q_start, row_ranges, B: int, S: int, who: str) -> None:
    if jnp.dtype(q_start.dtype) != jnp.dtype(jnp.int32) or tuple(q_start.shape) != (B,):
        raise ValueError(
            f"{who} primitive: `q_start` must be int32 [B] = [{B}], got "
            f"{_dtype_name(q_start.dtype)} {_fmt(q_start.shape)}"
        )
    if jnp.dtype(row_ranges.dtype) != jnp.dtype(jnp.int32) or tuple(row_ranges.shape) not in (
            (B, S, 0), (B, S, ROW_RANGE_FIELDS)):
        raise ValueError(
            f"{who} primitive: `row_ranges` must be int32 [B, S, {ROW_RANGE_FIELDS}] = [{B}, {S}, "
            f"{ROW_RANGE_FIELDS}] or [B, S, 0] (none), got {_dtype_name(row_ranges.dtype)} {_fmt(row_ranges.shape)}"
        )


def check_canonical(q, k, indices, lse, q_start, row_ranges, who: str = "attn_dist") -> Problem:
    """Validates the operands of the logical primitive: q [B,S,H,D],
    k [B,N,HK,D], indices [B,S,HK,T] int32, lse [B,S,H] f32, q_start [B]
    int32, row_ranges [B,S,3|0] int32."""
    if q.ndim != 4:
        raise ValueError(
            f"{who} primitive: `q` must be canonical [B, S, H, D], got {_fmt(q.shape)}"
        )
    problem = check_problem(q, k, indices, lse, who)
    _check_rule_operands(q_start, row_ranges, problem.B, problem.S, who)
    return problem


# ----------------------------------------------------------------------------
# the CUDA kernel's coverage
# ----------------------------------------------------------------------------


def kernel_supports(problem: Problem) -> Tuple[bool, str]:
    """Whether the CUDA kernel serves this problem, and if not, why.

    The kernel serves bfloat16 q/k, HK = 1 (MLA's MQA form), D in {512, 576},
    any H >= 1, any S, any T, and the batch natively. Empty problems (B, S, T
    or N zero) never reach the kernel: ``attn_dist`` returns zeros for them.
    """
    if problem.dtype != jnp.dtype(jnp.bfloat16):
        return False, f"the CUDA kernel takes bfloat16 q/k, got {_dtype_name(problem.dtype)}"
    if problem.HK != 1:
        return False, f"the CUDA kernel takes one kv head (HK = 1), got HK = {problem.HK}"
    if problem.D not in KERNEL_HEAD_DIMS:
        return False, (
            f"the CUDA kernel takes head dim D in {list(KERNEL_HEAD_DIMS)}, got D = {problem.D}"
        )
    return True, "supported"


# ----------------------------------------------------------------------------
# indexer_kl (SPEC §5)
# ----------------------------------------------------------------------------

#: ``weights`` dtypes ``indexer_kl`` accepts (used in float32).
INDEXER_WEIGHT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))

#: Indexer head dims DI the indexer CUDA kernel is built for.
INDEXER_KERNEL_HEAD_DIMS = (64, 128)

#: The most indexer heads HI the indexer CUDA kernel serves (4 tiles of 64).
INDEXER_KERNEL_MAX_HEADS = 256

#: The most indexer heads HI the backward kernel serves (one tile: its d index_q
#: accumulators for more heads would not fit the registers).
INDEXER_BWD_KERNEL_MAX_HEADS = 64


@dataclasses.dataclass(frozen=True)
class IndexerProblem:
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
    def scores(self) -> Problem:
        """The same sizes as an attn_dist-style problem (q = index_q,
        k = index_k with one kv head): the jnp chunk code serves both."""
        return Problem(batched=self.batched, B=self.B, S=self.S, H=self.HI, D=self.DI, N=self.N, HK=1,
                       T=self.T, dtype=self.dtype)


def check_indexer_problem(index_q, index_k, weights, indices, target, who: str = "indexer_kl") -> IndexerProblem:
    """Validates ``indexer_kl``'s array arguments (with or without the leading
    batch dimension) and returns the problem's sizes."""
    for name, x in (("index_q", index_q), ("index_k", index_k), ("weights", weights),
                    ("indices", indices), ("target", target)):
        _check_array(name, x, who)
    batched, B, (S, HI, DI), lead = _check_ranks(
        who, "index_q", index_q, "S, HI, DI",
        [("index_k", index_k, "N, DI", 2), ("weights", weights, "S, HI", 2), ("indices", indices, "S, 1, T", 3),
         ("target", target, "S, T", 2)])

    qdt = _check_operand_dtypes(who, "index_q", index_q, "index_k", index_k)
    wdt = jnp.dtype(weights.dtype)
    if wdt not in INDEXER_WEIGHT_DTYPES:
        raise TypeError(f"{who}: `weights` must have dtype float32 or bfloat16, got {_dtype_name(wdt)}")
    _check_indices_dtype(who, indices)
    if jnp.dtype(target.dtype) != jnp.dtype(jnp.float32):
        raise TypeError(f"{who}: `target` must have dtype float32, got {_dtype_name(target.dtype)}")

    if HI < 1 or DI < 1:
        raise ValueError(
            f"{who}: `index_q` must have at least one head and one feature (HI, DI >= 1), got shape "
            f"{_fmt(index_q.shape)}"
        )
    kshape = tuple(int(d) for d in index_k.shape)
    N = kshape[-2]
    want_k = ((B,) if batched else ()) + (N, DI)
    if kshape != want_k:
        raise ValueError(
            f"{who}: `index_k` must have shape [{lead}N, DI] with DI = {DI} (from `index_q`)"
            + (f" and B = {B}" if batched else "") + f", got {_fmt(kshape)}"
        )
    ishape = tuple(int(d) for d in indices.shape)
    T = ishape[-1]
    want_i = ((B,) if batched else ()) + (S, 1, T)
    if ishape != want_i:
        raise ValueError(
            f"{who}: `indices` must have shape [{lead}S, 1, T] = {_fmt(want_i)} (S, B from `index_q`; "
            f"one index list per query, as attn_dist takes it), got {_fmt(ishape)}"
        )
    for name, x, want, names in (
        ("weights", weights, ((B,) if batched else ()) + (S, HI), "S, HI"),
        ("target", target, ((B,) if batched else ()) + (S, T), "S, T"),
    ):
        shape = tuple(int(d) for d in x.shape)
        if shape != want:
            raise ValueError(f"{who}: `{name}` must have shape [{lead}{names}] = {_fmt(want)}, got {_fmt(shape)}")
    return IndexerProblem(batched=batched, B=B, S=S, HI=HI, DI=DI, N=N, T=T, dtype=qdt, weights_dtype=wdt)


def check_indexer_canonical(index_q, index_k, weights, indices, target, q_start, row_ranges,
                            who: str = "indexer_kl") -> IndexerProblem:
    """Validates the operands of the indexer primitives: index_q [B,S,HI,DI],
    index_k [B,N,DI], weights [B,S,HI], indices [B,S,1,T] int32,
    target [B,S,T] f32, q_start [B] int32, row_ranges [B,S,3|0] int32."""
    if index_q.ndim != 4:
        raise ValueError(f"{who} primitive: `index_q` must be canonical [B, S, HI, DI], got {_fmt(index_q.shape)}")
    problem = check_indexer_problem(index_q, index_k, weights, indices, target, who)
    _check_rule_operands(q_start, row_ranges, problem.B, problem.S, who)
    return problem


def check_flag(value: Any, name: str, who: str) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{who}: `{name}` must be a bool, got {type(value).__name__}: {value!r}")
    return bool(value)


@dataclasses.dataclass(frozen=True)
class IndexerParams:
    """``indexer_kl``'s static parameters, checked."""

    scale: float
    causal: bool
    k_stride: int
    deterministic: bool

    def as_dict(self):
        return dataclasses.asdict(self)


def check_indexer_params(*, scale, causal, k_stride, deterministic, who: str = "indexer_kl") -> IndexerParams:
    return IndexerParams(
        scale=check_sm_scale(scale, who, name="scale"),
        causal=check_causal(causal, who),
        k_stride=check_k_stride(k_stride, who),
        deterministic=check_flag(deterministic, "deterministic", who),
    )


def indexer_kernel_supports(problem: IndexerProblem) -> Tuple[bool, str]:
    """Whether the indexer CUDA kernel serves this problem, and if not, why:
    bfloat16 index_q/index_k, DI in {64, 128}, 1 <= HI <= 256; any S, T, N,
    batch; weights float32 or bfloat16."""
    if problem.dtype != jnp.dtype(jnp.bfloat16):
        return False, f"the indexer CUDA kernel takes bfloat16 index_q/index_k, got {_dtype_name(problem.dtype)}"
    if problem.DI not in INDEXER_KERNEL_HEAD_DIMS:
        return False, (
            f"the indexer CUDA kernel takes indexer head dim DI in {list(INDEXER_KERNEL_HEAD_DIMS)}, "
            f"got DI = {problem.DI}"
        )
    if problem.HI > INDEXER_KERNEL_MAX_HEADS:
        return False, f"the indexer CUDA kernel takes up to {INDEXER_KERNEL_MAX_HEADS} heads, got HI = {problem.HI}"
    return True, "supported"


def indexer_bwd_kernel_supports(problem: IndexerProblem, *, deterministic: bool = False) -> Tuple[bool, str]:
    """Whether the indexer backward CUDA kernels serve this problem: what the
    forward kernel serves with HI <= 64, in either mode (``deterministic``:
    d index_k by exact 64-bit fixed-point sums, SPEC §5.3)."""
    del deterministic  # both modes have a kernel
    ok, why = indexer_kernel_supports(problem)
    if not ok:
        return ok, why
    if problem.HI > INDEXER_BWD_KERNEL_MAX_HEADS:
        return False, (f"the indexer backward kernel takes up to {INDEXER_BWD_KERNEL_MAX_HEADS} heads, "
                       f"got HI = {problem.HI}")
    return True, "supported"


def indexer_bwd_workspace_bytes(index_k_shape, *, deterministic: bool) -> int:
    """The backward kernel's workspace in bytes (csrc/ffi.cc), for canonical
    index_k [B, N, DI]: the int64 fixed-point d index_k sums and one int64 word
    for the rows' bound when ``deterministic``, else none."""
    return 8 * (int(np.prod(index_k_shape)) + 1) if deterministic else 0


# ----------------------------------------------------------------------------
# packed sequences and per-row top-k lengths (SPEC §6)
# ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Packing:
    """The checked SPEC §6 keywords of one call (arrays as given, not yet
    cast). ``packed``: cu_seqlens were given (then ``q_start_index`` is an int
    or an array of shape [] or [num_seqs]); ``active``: any §6 keyword was."""

    topk_length: Any = None
    cu_seqlens_q: Any = None
    cu_seqlens_k: Any = None
    q_start_index: Any = 0

    @property
    def packed(self) -> bool:
        return self.cu_seqlens_q is not None

    @property
    def active(self) -> bool:
        return self.packed or self.topk_length is not None

    @property
    def num_seqs(self) -> int:
        return int(self.cu_seqlens_q.shape[0]) - 1 if self.packed else 0


def check_packing(topk_length, cu_seqlens_q, cu_seqlens_k, q_start_index, problem, who: str = "attn_dist") -> Packing:
    """Validates SPEC §6's keywords together with ``q_start_index`` (which,
    with cu_seqlens, is per sequence rather than per batch element).
    ``problem``: a :class:`Problem` or :class:`IndexerProblem`."""
    lead = (problem.B,) if problem.batched else ()
    if topk_length is not None:
        _check_int_array("topk_length", topk_length, who, "of shape [B?, S]")
        shape = tuple(int(d) for d in topk_length.shape)
        want = lead + (problem.S,)
        if shape != want:
            names = "[B, S]" if problem.batched else "[S]"
            raise ValueError(f"{who}: `topk_length` must have shape {names} = {_fmt(want)} (one length per query "
                             f"row), got {_fmt(shape)}")
    if (cu_seqlens_q is None) != (cu_seqlens_k is None):
        given, missing = ("cu_seqlens_q", "cu_seqlens_k") if cu_seqlens_k is None else ("cu_seqlens_k",
                                                                                         "cu_seqlens_q")
        raise ValueError(f"{who}: `{given}` was given without `{missing}`: the packed-sequence boundaries of the "
                         "queries and of the keys are given together (pass the same array twice when q and k "
                         "share one layout)")
    if cu_seqlens_q is None:
        return Packing(topk_length=topk_length, q_start_index=check_q_start_index(q_start_index, problem, who))
    if problem.batched:
        raise ValueError(f"{who}: `cu_seqlens_q`/`cu_seqlens_k` are accepted only with unbatched inputs (packed "
                         f"sequences share one row of tokens); the inputs carry a batch dimension B = {problem.B} "
                         "(use jax.vmap to give each example its own boundaries)")
    for name, x in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        _check_int_array(name, x, who, "of shape [num_seqs + 1]")
        if x.ndim != 1 or int(x.shape[0]) < 1:
            raise ValueError(f"{who}: `{name}` must have shape [num_seqs + 1] (rank 1, at least one entry), got "
                             f"{_fmt(x.shape)}")
    if tuple(cu_seqlens_q.shape) != tuple(cu_seqlens_k.shape):
        raise ValueError(f"{who}: `cu_seqlens_q` and `cu_seqlens_k` must have the same shape [num_seqs + 1], got "
                         f"{_fmt(cu_seqlens_q.shape)} and {_fmt(cu_seqlens_k.shape)}")
    q_start_index = check_q_start_index(q_start_index, problem, who, num_seqs=int(cu_seqlens_q.shape[0]) - 1)
    return Packing(topk_length=topk_length, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                   q_start_index=q_start_index)


def check_num_seqs(num_seqs: Any, who: str = "cu_seqlens_from_segment_ids") -> int:
    if isinstance(num_seqs, (bool, np.bool_)) or not isinstance(num_seqs, (int, np.integer)):
        raise TypeError(f"{who}: `num_seqs` must be a Python int >= 0 (static), got "
                        f"{type(num_seqs).__name__}: {num_seqs!r}")
    value = int(num_seqs)
    if not (0 <= value < INT32_MAX):
        raise ValueError(f"{who}: `num_seqs` must be an int >= 0, got {value}")
    return value


def check_segment_ids(segment_ids: Any, who: str = "cu_seqlens_from_segment_ids"):
    _check_int_array("segment_ids", segment_ids, who, "of shape [S] or [B, S]")
    if segment_ids.ndim not in (1, 2):
        raise ValueError(f"{who}: `segment_ids` must have rank 1 [S] or rank 2 [B, S], got shape "
                         f"{_fmt(segment_ids.shape)}")
    return segment_ids
