"""Argument checks shared by every op: arrays, ranks, dtypes, the static
parameters of the validity rule, ``q_start_index`` and the primitives'
rule operands.

The checks look at ``.shape`` and ``.dtype`` only, so they work on concrete
arrays, on ``ShapedArray`` avals and on tracers alike (they run at trace
time). Errors are ``TypeError`` (wrong kind or dtype) or ``ValueError``
(wrong shape or value); each message starts with the calling function's
name (``who``), names the argument, and gives the expected and the actual
value. Each op's own ``contract`` module builds its problem check from these.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Optional

import numpy as np
import jax
import jax.numpy as jnp

#: Operand dtypes the jnp paths accept. The CUDA kernels take bfloat16 only.
SUPPORTED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))

LSE_BASES = ("2", "e")
IMPLEMENTATIONS = (None, "cuda", "xla")

INT32_MIN = -(2**31)
INT32_MAX = 2**31 - 1
#: A row's slots (T, or indexer_topk's topk) the CUDA kernels take at most:
#: they count them in int32 and step up to 128 past the last one (the
#: handlers check the same limit: csrc/common/ffi_checks.h's kMaxSlots).
MAX_SLOTS = 2**30


def fmt_shape(shape) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def dtype_name(dt) -> str:
    return jnp.dtype(dt).name


def check_array(name: str, x: Any, who: str) -> None:
    if not (hasattr(x, "shape") and hasattr(x, "dtype")):
        raise TypeError(
            f"{who}: `{name}` must be an array (jax or numpy), got {type(x).__name__}"
        )


def check_ranks(who: str, name: str, x: Any, dims: str, others):
    """The rows operand ``x`` has rank 3 ``[dims]`` or 4 ``[B, dims]``; each
    ``(name, array, dims, unbatched rank)`` of ``others`` must agree. Returns
    ``(batched, B, x's other sizes, "B, " or "")``."""
    if x.ndim not in (3, 4):
        raise ValueError(
            f"{who}: `{name}` must have rank 3 [{dims}] or rank 4 [B, {dims}], "
            f"got rank {x.ndim} with shape {fmt_shape(x.shape)}"
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
                f"is {form} (shape {fmt_shape(x.shape)}), got rank {y.ndim} with shape "
                f"{fmt_shape(y.shape)}"
            )
    return batched, B, sizes, lead


def check_operand_dtypes(who: str, name: str, x: Any, partner_name: str, partner: Any):
    """``x`` and ``partner`` of one supported dtype (bfloat16; float16 and
    float32 on the jnp path); returns it."""
    dt, pdt = jnp.dtype(x.dtype), jnp.dtype(partner.dtype)
    if dt != pdt:
        raise TypeError(
            f"{who}: `{name}` and `{partner_name}` must have the same dtype (bfloat16; float16/float32 accepted "
            f"on the XLA path), got `{name}` {dtype_name(dt)} and `{partner_name}` {dtype_name(pdt)}"
        )
    if dt not in SUPPORTED_DTYPES:
        raise TypeError(
            f"{who}: `{name}` and `{partner_name}` must have dtype bfloat16 (float16/float32 accepted on the XLA "
            f"path), got {dtype_name(dt)}"
        )
    return dt


def check_indices_dtype(who: str, indices: Any) -> None:
    if jnp.dtype(indices.dtype) != jnp.dtype(jnp.int32):
        raise TypeError(
            f"{who}: `indices` must have dtype int32, got {dtype_name(indices.dtype)} "
            "(use indices.astype(jnp.int32))"
        )



def check_sm_scale(sm_scale: Any, who: str, name: str = "sm_scale") -> float:
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


def check_causal(causal: Any, who: str) -> bool:
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(
            f"{who}: `causal` must be a bool, got {type(causal).__name__}: {causal!r}"
        )
    return bool(causal)


def kernel_size_reason(*, S: int, N: int, T: Optional[int], rows: int, rows_what: str) -> Optional[str]:
    """Why a CUDA kernel cannot take these sizes, or None: S, N and the
    grid's ``rows`` (``rows_what`` names them) are counted in int32, a row's
    slots ``T`` (None: not known yet) are at most ``MAX_SLOTS``."""
    if S > INT32_MAX or N > INT32_MAX or rows > INT32_MAX or (T is not None and T > MAX_SLOTS):
        return (f"the CUDA kernels take S, N and {rows_what} below 2^31 and at most 2^30 slots a row, got S = {S}, "
                f"N = {N}, T = {T}, {rows_what} = {rows}")
    return None


def check_k_stride(k_stride: Any, who: str) -> int:
    if isinstance(k_stride, (bool, np.bool_)) or not isinstance(
        k_stride, (int, np.integer)
    ):
        raise TypeError(
            f"{who}: `k_stride` must be a Python int >= 1 (static), got "
            f"{type(k_stride).__name__}: {k_stride!r}"
        )
    value = int(k_stride)
    if not (1 <= value <= INT32_MAX):
        raise ValueError(f"{who}: `k_stride` must be an int >= 1 and at most 2^31 - 1, got {value}")
    return value


#: Which producers write which ``lse`` base: the one fact behind the
#: ``lse_base`` argument, quoted by its errors.
LSE_BASE_PRODUCERS = ('"e" for a natural-log lse (FlashMLA, cuDNN, TileLang\'s finetune kernels), '
                      '"2" for a log2-sum-exp2 lse (TileLang\'s sparse_mla_fwd)')


def check_lse_base(lse_base: Any, who: str) -> str:
    """``lse_base`` has no default: a wrong base gives silently wrong
    probabilities, so the caller names the base of the lse they pass."""
    if lse_base is None:
        raise TypeError(f"{who}: `lse_base` is required: pass {LSE_BASE_PRODUCERS}")
    if not isinstance(lse_base, str) or lse_base not in LSE_BASES:
        raise ValueError(f"{who}: `lse_base` must be {LSE_BASE_PRODUCERS}; got {lse_base!r}")
    return lse_base


def check_flag(value: Any, name: str, who: str) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{who}: `{name}` must be a bool, got {type(value).__name__}: {value!r}")
    return bool(value)


def check_implementation(implementation: Any, who: str) -> Optional[str]:
    if implementation is not None and (
        not isinstance(implementation, str) or implementation not in IMPLEMENTATIONS
    ):
        raise ValueError(
            f"{who}: `implementation` must be None (the CUDA kernel where it "
            "applies, else XLA), \"cuda\" or \"xla\", got "
            f"{implementation!r}"
        )
    return implementation



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
        raise TypeError(f"{who}: `{name}` must have an integer dtype (it is cast to int32), got {dtype_name(dt)}")
    info = jnp.iinfo(dt)
    if info.min < INT32_MIN or info.max > INT32_MAX:  # the cast to int32 could wrap
        if isinstance(x, jax.core.Tracer):
            raise TypeError(f"{who}: a traced `{name}` must be int32 (or narrower), got {dtype_name(dt)}, "
                            "whose values cannot be range-checked at trace time")
        values = np.asarray(x)
        if values.size and (values.min() < INT32_MIN or values.max() > INT32_MAX):
            raise ValueError(f"{who}: `{name}` must fit in int32, got values in [{values.min()}, {values.max()}]")


def check_int_array(name: str, x: Any, who: str, what: str):
    """An integer array (cast to int32 by the caller) whose values fit int32:
    ``q_start_index`` and SPEC §6's arrays. Returns the array as given."""
    if isinstance(x, (bool, np.bool_)) or not (hasattr(x, "shape") and hasattr(x, "dtype")):
        raise TypeError(f"{who}: `{name}` must be an int32 array {what}, got {type(x).__name__}: {x!r}")
    _check_int32_values(name, x, who)
    return x


def check_q_start_index(q_start_index: Any, problem, who: str, num_seqs: Optional[int] = None):
    """Returns either a Python int (checked to fit int32) or the array as given
    (checked: integer dtype, shape [] or, when batched, [B]; with cu_seqlens,
    ``num_seqs`` given, [] or [num_seqs]: one start per sequence). The caller
    casts arrays to int32."""
    if isinstance(q_start_index, (bool, np.bool_, int)):
        return _check_python_int32("q_start_index", q_start_index, who)
    per, length = ("num_seqs", num_seqs) if num_seqs is not None else ("B", problem.B)
    check_int_array("q_start_index", q_start_index, who, f"of shape [] or [{per}] (or a Python int)")
    shape = tuple(int(d) for d in q_start_index.shape)
    if shape == ():
        return q_start_index
    if num_seqs is None and not problem.batched:
        raise ValueError(
            f"{who}: `q_start_index` must be a scalar (shape []) when the inputs "
            f"are unbatched, got shape {fmt_shape(shape)}"
        )
    if shape == (length,):
        return q_start_index
    if num_seqs is not None:
        raise ValueError(f"{who}: with cu_seqlens, `q_start_index` must be a Python int or an array of shape [] "
                         f"or [num_seqs] = [{num_seqs}] (one start position per sequence), got {fmt_shape(shape)}")
    raise ValueError(f"{who}: `q_start_index` must have shape [] or [B] = [{length}], got {fmt_shape(shape)}")


#: SPEC §6's per-row ranges, the primitives' ``row_ranges`` operand: int32
#: ``[B, S, ROW_RANGE_FIELDS]`` holding, per query row, ``key_begin``,
#: ``key_end`` and ``topk_length``: slot ``j`` selecting key ``i`` is valid iff
#: ``j < topk_length`` and ``key_begin <= i < key_end`` (each clamped: the
#: keys into ``[0, N]``, the length into ``[0, T]``). They replace SPEC §2's
#: causal rule for the call. ``[B, S, 0]`` means none: SPEC §2's rule
#: applies. ``packing.row_ranges`` computes them; csrc/common/ holds the
#: same field count.
ROW_RANGE_FIELDS = 3


def no_row_ranges(B: int, S: int):
    """The ``row_ranges`` operand of a call without SPEC §6 keywords."""
    return jnp.zeros((B, S, 0), jnp.int32)


def check_rule_operands(q_start, row_ranges, B: int, S: int, who: str) -> None:
    if jnp.dtype(q_start.dtype) != jnp.dtype(jnp.int32) or tuple(q_start.shape) != (B,):
        raise ValueError(
            f"{who} primitive: `q_start` must be int32 [B] = [{B}], got "
            f"{dtype_name(q_start.dtype)} {fmt_shape(q_start.shape)}"
        )
    if jnp.dtype(row_ranges.dtype) != jnp.dtype(jnp.int32) or tuple(row_ranges.shape) not in (
            (B, S, 0), (B, S, ROW_RANGE_FIELDS)):
        raise ValueError(
            f"{who} primitive: `row_ranges` must be int32 [B, S, {ROW_RANGE_FIELDS}] = [{B}, {S}, "
            f"{ROW_RANGE_FIELDS}] or [B, S, 0] (none), got {dtype_name(row_ranges.dtype)} {fmt_shape(row_ranges.shape)}"
        )


def canonicalize(problem, *arrays_and_q_start):
    """Adds the batch dimension to every array when absent and makes the
    last argument, ``q_start_index`` (int or int array [] / [B]), int32 [B]."""
    *arrays, q_start_index = arrays_and_q_start
    if not problem.batched:
        arrays = [x[None] for x in arrays]
    arrays = [jnp.asarray(x) for x in arrays]
    if isinstance(q_start_index, int):
        q_start = jnp.full((problem.B,), q_start_index, jnp.int32)
    else:
        q_start = jnp.broadcast_to(jnp.asarray(q_start_index).astype(jnp.int32), (problem.B,))
    return (*arrays, q_start)


def check_keys_and_indices(who: str, q, k_name: str, k, indices, batched: bool, B: int, S: int, H: int, D: int,
                           lead: str):
    """The sizes of a query's keys ``k`` [B?, N, HK, D] (named ``k_name``)
    and slot indices [B?, S, HK, T] against q's (attn_dist, sparse_mla);
    ranks were checked. Returns (N, HK, T)."""
    kshape = tuple(int(d) for d in k.shape)
    if batched:
        kB, N, HK, kD = kshape
    else:
        N, HK, kD = kshape
        kB = B
    if H < 1:
        raise ValueError(f"{who}: `q` must have at least one head (H >= 1), got shape {fmt_shape(q.shape)}")
    if HK < 1 or H % HK != 0:
        raise ValueError(
            f"{who}: the number of kv heads HK of `{k_name}` must be >= 1 and divide H = {H} (MLA: HK = 1; "
            f"head h uses kv head h // (H // HK)), got HK = {HK} ({k_name} shape {fmt_shape(k.shape)})"
        )
    if batched and kB != B:
        raise ValueError(
            f"{who}: `{k_name}` must have shape [B, N, HK, D] with B = {B} and D = {D} (from `q`), got "
            f"{fmt_shape(k.shape)}"
        )
    if kD != D:
        raise ValueError(
            f"{who}: `{k_name}` must have shape [{lead}N, HK, D] with D = {D} (from `q`), got {fmt_shape(k.shape)}"
        )
    ishape = tuple(int(d) for d in indices.shape)
    T = ishape[-1]
    want_i = ((B,) if batched else ()) + (S, HK, T)
    if ishape != want_i:
        raise ValueError(
            f"{who}: `indices` must have shape [{lead}S, HK, T] = {fmt_shape(want_i)} (S, B from `q`, HK from "
            f"`{k_name}`), got {fmt_shape(ishape)}"
        )
    return N, HK, T
