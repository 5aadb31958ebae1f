"""dsa_attention's public function (SPEC §10): ``indexer_topk`` (no
gradient), ``sparse_mla`` on its indices, and the indexer's KL loss towards
the sparse attention's own mass on those indices (``indexer_loss``'s target:
``attn_dist`` from the same lse, all heads summed, L1-normalised, under
``stop_gradient``).

The arguments are checked once, at trace time, with the four ops' contract
checks under the name ``dsa_attention``, plus the agreements between the
attention's and the indexer's arrays (B, S, N). SPEC §6's keywords become
one set of per-row ranges that every op takes, and the ops' canonical
functions are bound directly, so each op keeps its own kernels, sharding
and vmap rules and custom VJP.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from ..._core import checks, packing
from ..._core.checks import canonicalize
from ..._core.primitives import require_kernel
from ...ops.attn_dist import contract as attn_contract
from ...ops.attn_dist.autodiff import attn_dist_canonical
from ...ops.indexer import contract as indexer_contract
from ...ops.indexer.autodiff import indexer_kl_canonical
from ...ops.indexer.reference import target_from_dist
from ...ops.indexer_topk import contract as topk_contract
from ...ops.indexer_topk.autodiff import indexer_topk_canonical
from ...ops.sparse_mla import contract as mla_contract
from ...ops.sparse_mla.autodiff import sparse_mla_canonical

WHO = "dsa_attention"

#: The base of the returned ``lse`` (and of the one attn_dist reads): the
#: natural log, as FlashMLA and cuDNN write it.
LSE_BASE = "e"


class DsaAttentionOutput(NamedTuple):
    """What :func:`dsa_attention` returns (a pytree: jit, vmap and sharding
    see four arrays)."""

    out: Any          #: ``[B?, S, H, d_v]``, q's dtype: the attention output
    indexer_kl: Any   #: ``[B?, S]`` float32: the indexer's KL loss per query row
    indices: Any      #: ``[B?, S, 1, topk]`` int32: the selected keys, ascending, then -1
    lse: Any          #: ``[B?, S, H]`` float32: natural-log log-sum-exp (-inf: no valid key)


@dataclasses.dataclass(frozen=True)
class _Checked:
    mla: Any          # sparse_mla contract Problem (T = topk)
    attn: Any         # attn_dist contract Problem
    index: Any        # indexer contract Problem
    topk: Any         # indexer_topk contract Problem (T = topk)
    params: tuple     # (topk, sparse_mla, attn_dist, indexer) params
    packed: Any
    implementation: Any


def _shape(x):
    return tuple(int(d) for d in x.shape)


def _check_agreement(q, kv, index_q, index_k, batched, B, lead):
    """The attention's and the indexer's arrays describe the same queries
    and keys: the ops' own checks see each side alone."""
    n = int(batched)
    iq = _shape(index_q)
    if iq[:n + 1] != _shape(q)[:n + 1]:
        raise ValueError(f"{WHO}: `index_q` must have the query rows of `q`: [{lead}S] = "
                         f"{checks.fmt_shape(_shape(q)[:n + 1])} (from `q` {checks.fmt_shape(q.shape)}), got "
                         f"`index_q` {checks.fmt_shape(index_q.shape)}")
    kvs, iks = _shape(kv), _shape(index_k)
    if batched and kvs[0] != B:
        raise ValueError(f"{WHO}: `kv` must have the batch size of `q`, B = {B}, got `kv` "
                         f"{checks.fmt_shape(kv.shape)}")
    if batched and iks[0] != B:
        raise ValueError(f"{WHO}: `index_k` must have the batch size of `q`, B = {B}, got `index_k` "
                         f"{checks.fmt_shape(index_k.shape)}")
    if kvs[-2] != 1:
        raise ValueError(f"{WHO}: `kv` must have one kv head (shape [{lead}N, 1, D], MLA's shared latent): the "
                         f"indexer selects one key list per query, got `kv` {checks.fmt_shape(kv.shape)}")
    if iks[-2] != kvs[-3]:
        raise ValueError(f"{WHO}: `kv` and `index_k` must hold the same keys (one row per key, N), got N = "
                         f"{kvs[-3]} from `kv` {checks.fmt_shape(kv.shape)} and N = {iks[-2]} from `index_k` "
                         f"{checks.fmt_shape(index_k.shape)}")


def check_call(q, kv, index_q, index_k, weights, *, sm_scale, topk, d_v, indexer_scale, causal, q_start_index,
               k_stride, cu_seqlens_q, cu_seqlens_k, deterministic, implementation) -> _Checked:
    """Every check of a ``dsa_attention`` call (trace time; messages start
    with ``dsa_attention``)."""
    for name, x in (("q", q), ("kv", kv), ("index_q", index_q), ("index_k", index_k), ("weights", weights)):
        checks.check_array(name, x, WHO)
    batched, B, _, lead = checks.check_ranks(
        WHO, "q", q, "S, H, D", [("kv", kv, "N, 1, D", 3), ("index_q", index_q, "S, HI, DI", 3),
                                 ("index_k", index_k, "N, DI", 2), ("weights", weights, "S, HI", 2)])
    _check_agreement(q, kv, index_q, index_k, batched, B, lead)
    topk = topk_contract.check_topk(topk, WHO)
    indexer_scale = checks.check_sm_scale(indexer_scale, WHO, name="indexer_scale")
    rows = _shape(q)[:int(batched) + 1]  # [B?, S]
    indices = jax.ShapeDtypeStruct(rows + (1, topk), jnp.int32)
    mla = mla_contract.check_problem(q, kv, indices, WHO)
    attn = attn_contract.check_problem(q, kv, indices, jax.ShapeDtypeStruct(mla.lse_shape, jnp.float32), WHO)
    index = indexer_contract.check_problem(index_q, index_k, weights, indices,
                                           jax.ShapeDtypeStruct(rows + (topk,), jnp.float32), WHO)
    topk_problem = dataclasses.replace(topk_contract.check_problem(index_q, index_k, weights, None, WHO), T=topk)
    rule = dict(causal=causal, k_stride=k_stride, who=WHO)
    params = (
        topk_contract.check_params(topk=topk, scale=indexer_scale, **rule),
        mla_contract.check_params(mla, sm_scale=sm_scale, lse_base=LSE_BASE, d_v=d_v, deterministic=deterministic,
                                  **rule),
        attn_contract.check_params(sm_scale=sm_scale, lse_base=LSE_BASE, **rule),
        indexer_contract.check_params(scale=indexer_scale, deterministic=deterministic, **rule),
    )
    implementation = checks.check_implementation(implementation, WHO)
    packed = packing.check_packing(None, cu_seqlens_q, cu_seqlens_k, q_start_index, mla, WHO)
    if implementation == "cuda":
        for supported in (topk_contract.kernel_supports(topk_problem),
                          mla_contract.kernel_supports(mla, d_v=params[1].d_v),
                          attn_contract.kernel_supports(attn), indexer_contract.kernel_supports(index)):
            require_kernel(WHO, *supported)
    return _Checked(mla=mla, attn=attn, index=index, topk=topk_problem, params=params, packed=packed,
                    implementation=implementation)


def dsa_attention(
    q, kv, index_q, index_k, weights, *, sm_scale, topk, d_v=mla_contract.KERNEL_D_V, indexer_scale=1.0,
    causal=True, q_start_index=0, k_stride=1, cu_seqlens_q=None, cu_seqlens_k=None, deterministic=False,
    implementation=None,
) -> DsaAttentionOutput:
    """A DeepSeek Sparse Attention layer: the lightning indexer's top-k, sparse
    MLA attention over it, and the indexer's KL loss (SPEC §10)::

        indices    = indexer_topk(index_q, index_k, weights, topk=topk, scale=indexer_scale)   # no gradient
        out, lse   = sparse_mla(q, kv, indices, sm_scale=sm_scale, d_v=d_v, lse_base="e")
        indexer_kl = indexer_loss(q, kv, lse, index_q, index_k, weights, indices,
                                  sm_scale=sm_scale, lse_base="e", scale=indexer_scale)

    The KL's target is the attention's probability mass on each selected key,
    all heads summed and L1-normalised, under ``stop_gradient``.

    Args:
      q: ``[B?, S, H, D]`` bfloat16 (float16/float32 on the XLA path).
      kv: ``[B?, N, 1, D]``, dtype of ``q``: the MLA latent (keys; its first
        ``d_v`` features are the values).
      index_q: ``[B?, S, HI, DI]`` bfloat16 (float16/float32 on the XLA path).
      index_k: ``[B?, N, DI]``, dtype of ``index_q``: the same N keys as ``kv``.
      weights: ``[B?, S, HI]`` float32 or bfloat16.
      sm_scale: the attention's softmax scale (finite float > 0, static).
      topk: keys selected per query row (int >= 1, static; may exceed N).
      d_v: value width (static, ``1 <= d_v <= D``; the kernels: 512).
      indexer_scale: multiplies the indexer's logits, for the selection and
        the KL alike (finite float > 0, static).
      causal, q_start_index, k_stride: the validity rule of every op (SPEC
        §2.2; ``q_start_index`` may be traced, ``[B]`` when batched).
      cu_seqlens_q, cu_seqlens_k: packed sequences (SPEC §6.2), unbatched
        inputs only; every op sees the same per-row ranges.
      deterministic: bitwise-reproducible gradients (sparse_mla's and the
        indexer's backward); the selection is deterministic either way.
      implementation: ``None`` (each op's CUDA kernel where it applies when
        lowered for CUDA, else XLA), ``"cuda"`` (raise unless every op's
        forward kernel can serve the call) or ``"xla"`` (the jnp paths).

    Returns:
      :class:`DsaAttentionOutput` ``(out, indexer_kl, indices, lse)``:
      ``out`` ``[B?, S, H, d_v]`` in q's dtype, ``indexer_kl`` float32
      ``[B?, S]`` (mask and reduce it yourself), ``indices`` int32
      ``[B?, S, 1, topk]``, ``lse`` float32 ``[B?, S, H]`` (natural log).

    Gradients: ``out`` and ``lse`` reach ``q`` and ``kv`` only (SPEC §8.3);
    ``indexer_kl`` reaches ``index_q``, ``index_k`` and ``weights`` only
    (SPEC §5.3). ``indices`` has none. Every array has the leading batch
    dimension B, or none does. Errors in shapes, dtypes or parameters raise
    ``TypeError``/``ValueError`` at trace time, starting with
    ``dsa_attention``.
    """
    c = check_call(q, kv, index_q, index_k, weights, sm_scale=sm_scale, topk=topk, d_v=d_v,
                   indexer_scale=indexer_scale, causal=causal, q_start_index=q_start_index, k_stride=k_stride,
                   cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, deterministic=deterministic,
                   implementation=implementation)
    problem = c.mla
    topk_params, mla_params = c.params[:2]
    if problem.is_empty:  # no row or no key: nothing to select or attend to
        lead = (problem.B,) if problem.batched else ()
        return DsaAttentionOutput(
            out=jnp.zeros(problem.out_shape(mla_params.d_v), q.dtype),
            indexer_kl=jnp.zeros(lead + (problem.S,), jnp.float32),
            indices=jnp.full(lead + (problem.S, 1, problem.T), -1, jnp.int32),
            lse=jnp.full(problem.lse_shape, -jnp.inf, jnp.float32))

    # SPEC §6 once: every op sees the same rows' key ranges.
    q_start_index, ranges, *params = packing.rule_operands(problem, c.packed, *c.params)
    topk_params, mla_params, attn_params, index_params = params
    q, kv, index_q, index_k, weights, q_start = canonicalize(problem, q, kv, index_q, index_k, weights,
                                                             q_start_index)
    impl = dict(implementation=c.implementation)

    ones = jnp.ones((problem.B, problem.N), jnp.float32)  # no per-key scale (bf16 keys)
    indices = indexer_topk_canonical(index_q, index_k, weights, ones, q_start, ranges, **impl,
                                     **topk_params.as_dict())
    indices = jax.lax.stop_gradient(indices)                                               # [B, S, 1, topk]
    out, lse = sparse_mla_canonical(q, kv, indices, q_start, ranges, **impl, **mla_params.as_dict())

    # The teacher: no gradient reaches q, kv or the lse through it.
    q_t, kv_t, lse_t = (jax.lax.stop_gradient(x) for x in (q, kv, lse))
    dist = attn_dist_canonical(q_t, kv_t, indices, lse_t, q_start, ranges, **impl, **attn_params.as_dict())
    kl = indexer_kl_canonical(index_q, index_k, weights, indices, target_from_dist(dist), q_start, ranges, **impl,
                              **index_params.as_dict())
    result = DsaAttentionOutput(out=out, indexer_kl=kl, indices=indices, lse=lse)
    return result if problem.batched else DsaAttentionOutput(*(x[0] for x in result))
