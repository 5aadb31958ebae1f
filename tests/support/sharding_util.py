"""Helpers shared by the sharding tests (host CPU devices and GPUs); not a
test module."""

from __future__ import annotations

import contextlib
import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np

from jax_attn_dist import synthetic

COLLECTIVES = ("all-gather", "all-reduce", "all-to-all", "collective-permute", "reduce-scatter")


@contextlib.contextmanager
def partitioner(shardy: bool):
    """jax_use_shardy_partitioner for the block (False: the legacy GSPMD
    partitioner), restored after it."""
    prev = jax.config.jax_use_shardy_partitioner
    jax.config.update("jax_use_shardy_partitioner", shardy)
    try:
        yield
    finally:
        jax.config.update("jax_use_shardy_partitioner", prev)


def collectives(hlo: str):
    """The collectives in compiled HLO text."""
    return {c for c in COLLECTIVES if re.search(rf"\b{c}(-start)?\(", hlo)}


def bits(x):
    """A float32 array's bits (to compare results bit for bit)."""
    return np.asarray(x).view(np.uint32)


def same_bits(a, b) -> bool:
    """Whether two arrays of any dtype hold the same shape, dtype and bits."""
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


def gpu_mesh(n: int = 2, name: str = "x"):
    """A 1-D mesh of the first ``n`` CUDA GPUs."""
    return jax.sharding.Mesh(np.array(jax.devices("cuda")[:n]), (name,))


def mixed_synthetic_problem(seed, *, S, N, H, T, D, **kw):
    """A synthetic DSA problem with 30% of the slots replaced by random keys,
    many of them causally invisible (so the per-shard offsets matter)."""
    prob = synthetic.make_problem(S=S, N=N, H=H, T=T, D=D, seed=seed, **kw)
    rng = np.random.default_rng(seed)
    idx = np.asarray(prob.indices)
    mix = np.where(rng.random(idx.shape) < 0.3, rng.integers(0, N, idx.shape), idx)
    return dataclasses.replace(prob, indices=jnp.asarray(mix, jnp.int32))
