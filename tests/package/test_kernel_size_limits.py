"""SPEC §11: every op's kernel_supports refuses, with the sizes, the calls its
kernel cannot count in int32 (S, N, the grid's rows below 2^31, at most 2^30
slots a row) and serves those just inside."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest

from jax_attn_dist._core import checks
from jax_attn_dist.ops.attn_dist import contract as attn_contract
from jax_attn_dist.ops.indexer import contract as indexer_contract
from jax_attn_dist.ops.indexer_topk import contract as topk_contract
from jax_attn_dist.ops.sparse_mla import contract as mla_contract

BF16, F32, I32 = jnp.bfloat16, jnp.float32, jnp.int32


def _zeros(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype)


def _problems():
    """A small kernel-served problem of each op, and its kernel_supports."""
    B, S, H, D, N, T, HI, DI = 1, 4, 64, 576, 32, 64, 64, 128
    attn = attn_contract.check_problem(_zeros((B, S, H, D), BF16), _zeros((B, N, 1, D), BF16),
                                       _zeros((B, S, 1, T), I32), _zeros((B, S, H), F32))
    index = indexer_contract.check_problem(_zeros((B, S, HI, DI), BF16), _zeros((B, N, DI), BF16),
                                           _zeros((B, S, HI), F32), _zeros((B, S, 1, T), I32), _zeros((B, S, T), F32))
    mla = mla_contract.check_problem(_zeros((B, S, H, D), BF16), _zeros((B, N, 1, D), BF16),
                                     _zeros((B, S, 1, T), I32))
    topk = dataclasses.replace(topk_contract.check_problem(_zeros((B, S, HI, DI), BF16), _zeros((B, N, DI), BF16),
                                                           _zeros((B, S, HI), F32)), T=T)
    return {"attn_dist": (attn, attn_contract.kernel_supports), "indexer_kl": (index, indexer_contract.kernel_supports),
            "sparse_mla": (mla, mla_contract.kernel_supports), "indexer_topk": (topk, topk_contract.kernel_supports)}


@pytest.mark.parametrize("op", ["attn_dist", "indexer_kl", "sparse_mla", "indexer_topk"])
@pytest.mark.parametrize("field,inside,outside", [
    ("T", checks.MAX_SLOTS, checks.MAX_SLOTS + 1),
    ("S", 2**31 - 1, 2**31),
    ("N", 2**31 - 1, 2**31),
])
def test_kernel_supports_stops_at_the_int32_limits(op, field, inside, outside):
    problem, supports = _problems()[op]
    assert supports(problem) == (True, "supported")
    ok, why = supports(dataclasses.replace(problem, **{field: outside}))
    assert not ok and "below 2^31" in why and str(outside) in why, why
    assert supports(dataclasses.replace(problem, **{field: inside}))[0]


@pytest.mark.parametrize("op,B,S,H", [("attn_dist", 2, 2**30, 64), ("sparse_mla", 1, 2**28, 1024)])
def test_kernel_supports_counts_the_grid_rows(op, B, S, H):
    """The grid's rows (B * S times the head groups or tiles) below 2^31."""
    problem, supports = _problems()[op]
    ok, why = supports(dataclasses.replace(problem, B=B, S=S, H=H))
    assert not ok and "B * S *" in why, why
