"""Synthetic DSA-shaped problems for the demo, the benchmark and the tests.

``make_problem`` draws seeded random q/k, picks for each query (and kv head)
``T`` distinct keys among those visible under the causal rule (top-k of random
scores with the invisible keys masked out; padded with -1 where fewer than T
are visible, as a top-k selector would), and computes ``lse`` exactly from
those: the float32 log-sum-exp, in the chosen base, of
``z = sm_scale * q.k`` over the valid slots (+inf where a row has none, as
FlashMLA writes). With that ``lse`` every head's probabilities sum to 1, so
each group row of ``attn_dist`` sums to the number of heads in the group.

Everything is generated with ``jax.random`` (threefry: the same bits on every
backend) in chunks of query rows, so large benchmark shapes fit on a GPU.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np

from ._core.chunks import causal_parts, row_chunked, valid_slots
from .ops.attn_dist import contract as attn_contract
from .ops.attn_dist.reference import exact_lse_canonical


@dataclasses.dataclass
class SyntheticProblem:
    q: Any
    k: Any
    indices: Any
    lse: Any
    q_start_index: Any  # int, or int32 array [B]
    sm_scale: float
    causal: bool
    k_stride: int
    lse_base: str

    @property
    def arrays(self):
        return (self.q, self.k, self.indices, self.lse)

    @property
    def kwargs(self):
        """Keyword arguments for ``attn_dist`` / ``attn_dist_reference``."""
        return dict(
            sm_scale=self.sm_scale, causal=self.causal, q_start_index=self.q_start_index,
            k_stride=self.k_stride, lse_base=self.lse_base,
        )

    @property
    def batched(self) -> bool:
        return self.q.ndim == 4

    @property
    def flops(self) -> int:
        """2 * B * S * H * T * D (SPEC §4: every slot counted)."""
        B = self.q.shape[0] if self.batched else 1
        S, H, D = self.q.shape[-3:]
        T = self.indices.shape[-1]
        return 2 * B * S * H * T * D


def default_q_start(S: int, N: int, k_stride: int) -> int:
    """The queries are the last S positions of a sequence whose N compressed
    keys cover ``N * k_stride`` positions: the last query sees every key."""
    return max(N * k_stride - S, 0)


def _topk_indices(key, B, S, N, HK, T, q_start, *, causal, k_stride):
    """int32 [B, S, HK, T]: per (query, kv head), T distinct visible keys in
    random order (top-k of uniform scores), -1 where fewer are visible."""
    R = B * S
    kk = min(T, N)
    C = max(1, min(R, (64 << 20) // max(HK * N * 4, 1)))
    qq, qr = causal_parts(q_start, k_stride)
    keys_all = jnp.broadcast_to(jnp.arange(N, dtype=jnp.int32), (1, HK, N))

    def body(start):
        rows = start + jnp.arange(C, dtype=jnp.int32)
        scores = jax.vmap(lambda r: jax.random.uniform(jax.random.fold_in(key, r), (HK, N)))(rows)
        b_rows = rows // S
        s_rows = rows - b_rows * S
        visible, _ = valid_slots(
            jnp.broadcast_to(keys_all, (C, HK, N)), b_rows, s_rows, qq, qr, None,
            N=N, causal=causal, k_stride=k_stride,
        )
        scores = jnp.where(visible, scores, -jnp.inf)
        top, idx = jax.lax.top_k(scores, kk)
        idx = jnp.where(jnp.isfinite(top), idx, -1).astype(jnp.int32)
        if kk < T:
            idx = jnp.concatenate([idx, jnp.full((C, HK, T - kk), -1, jnp.int32)], axis=-1)
        return idx

    return row_chunked(body, R, C, (HK, T), jnp.int32).reshape(B, S, HK, T)


def make_problem(
    *, S: int, N: int, H: int, T: int, D: int, B: Optional[int] = None, HK: int = 1,
    dtype=jnp.bfloat16, causal: bool = True,
    q_start_index: Union[None, int, Sequence[int]] = None, k_stride: int = 1,
    lse_base: str = "2", sm_scale: Optional[float] = None, seed: int = 0,
) -> SyntheticProblem:
    """A seeded random problem. ``B=None`` gives unbatched arrays.

    ``q_start_index``: None picks :func:`default_q_start`; an int; or (batched)
    a sequence of B ints, returned as an int32 array. ``sm_scale`` defaults to
    ``D ** -0.5`` (any positive value is valid; it only has to match the lse).
    """
    batched = B is not None
    Bc = B if batched else 1
    sm_scale = float(D ** -0.5) if sm_scale is None else float(sm_scale)
    if q_start_index is None:
        q_start_index = default_q_start(S, N, k_stride)
    if isinstance(q_start_index, (int, np.integer)):
        q_start_index = int(q_start_index)
        q_start = jnp.full((Bc,), q_start_index, jnp.int32)
    else:
        if not batched:
            raise ValueError("a per-batch q_start_index needs B")
        q_start = jnp.asarray(np.asarray(q_start_index, np.int64).astype(np.int32)).reshape(Bc)
        q_start_index = q_start

    kq, kk, ki = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(kq, (Bc, S, H, D), jnp.float32).astype(dtype)
    k = jax.random.normal(kk, (Bc, N, HK, D), jnp.float32).astype(dtype)
    indices = jax.jit(
        _topk_indices, static_argnums=(1, 2, 3, 4, 5), static_argnames=("causal", "k_stride"),
    )(ki, Bc, S, N, HK, T, q_start, causal=causal, k_stride=k_stride)
    lse = jax.jit(
        exact_lse_canonical, static_argnames=("sm_scale", "causal", "k_stride", "lse_base", "empty_value"),
    )(q, k, indices, q_start, sm_scale=sm_scale, causal=causal, k_stride=k_stride, lse_base=lse_base)

    if not batched:
        q, k, indices, lse = q[0], k[0], indices[0], lse[0]
    problem = SyntheticProblem(q, k, indices, lse, q_start_index, sm_scale, causal, k_stride, lse_base)
    attn_contract.check_problem(*problem.arrays)
    return problem


def heads_per_group(H: int) -> np.ndarray:
    """[G] int: the number of heads each output group sums."""
    G = attn_contract.num_groups(H)
    return np.minimum(H - attn_contract.HEADS_PER_GROUP * np.arange(G), attn_contract.HEADS_PER_GROUP)


def invariant_error(out, lse) -> float:
    """For an ``lse`` that is the exact LSE of the valid set (as
    ``make_problem`` writes; non-finite where a head has no valid key): the
    largest deviation of a group row's sum from the number of heads of the
    group that have a valid key, relative to the group's size."""
    out = np.asarray(out, np.float64)
    lse = np.asarray(lse)
    if out.ndim == 3:
        out, lse = out[None], lse[None]
    if out.size == 0:
        return 0.0
    B, S, H = lse.shape
    G = attn_contract.num_groups(H)
    finite = np.isfinite(lse).astype(np.float64)  # [B, S, H]
    pad = G * attn_contract.HEADS_PER_GROUP - H
    finite = np.pad(finite, ((0, 0), (0, 0), (0, pad)))
    expected = finite.reshape(B, S, G, -1).sum(axis=-1).transpose(0, 2, 1)  # [B, G, S]
    n = heads_per_group(H)[None, :, None]
    return float((np.abs(out.sum(axis=-1) - expected) / n).max())


# ----------------------------------------------------------------------------
# the lightning indexer (SPEC §5)
# ----------------------------------------------------------------------------


@dataclasses.dataclass
class SyntheticIndexer:
    """Indexer inputs matching a :class:`SyntheticProblem`'s rows and keys."""

    index_q: Any   # [B?, S, HI, DI]
    index_k: Any   # [B?, N, DI]
    weights: Any   # [B?, S, HI] float32

    @property
    def arrays(self):
        return (self.index_q, self.index_k, self.weights)


def make_indexer(problem: SyntheticProblem, *, HI: int = 64, DI: int = 128, dtype=jnp.bfloat16,
                 weights_dtype=jnp.float32, seed: int = 0) -> SyntheticIndexer:
    """Seeded random indexer inputs for ``problem``'s queries and keys:
    index_q, index_k ~ N(0, 1/sqrt(DI)) per element (so z ~ N(0, 1)) and
    weights ~ N(0, 1/sqrt(HI)), as DeepSeek folds HI**-0.5 into them; the
    logits then spread over a few units."""
    lead = problem.q.shape[:-3]
    S, N = problem.q.shape[-3], problem.k.shape[-3]
    kq, kk, kw = jax.random.split(jax.random.key(seed + 7919), 3)
    index_q = (jax.random.normal(kq, lead + (S, HI, DI), jnp.float32) * DI ** -0.25).astype(dtype)
    index_k = (jax.random.normal(kk, lead + (N, DI), jnp.float32) * DI ** -0.25).astype(dtype)
    weights = (jax.random.normal(kw, lead + (S, HI), jnp.float32) * HI ** -0.5).astype(weights_dtype)
    return SyntheticIndexer(index_q, index_k, weights)
