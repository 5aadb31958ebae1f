"""What attn_dist's sharding tests on 8 host CPU devices share: the meshes,
the ``Case`` record of a sharded call, its inputs, the unsharded reference and
the comparison. Not a test file: ``attn_dist/test_sharding.py`` (jit with
shardings, partitioned by Shardy or GSPMD) and ``attn_dist/test_shard_map.py``
use these; ``attn_dist/test_sharding_cuda_lowering.py`` uses the meshes.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jax_attn_dist import attn_dist
from inputs import make_inputs, seed_of

AUTO = jax.sharding.AxisType.Auto


def make_mesh(shape, names, axis_types=None):
    devices = np.array(jax.devices("cpu")[: int(np.prod(shape))]).reshape(shape)
    types = axis_types or (AUTO,) * len(shape)
    return jax.sharding.Mesh(devices, names, axis_types=types)


class Case(NamedTuple):
    name: str
    mesh: Tuple[Tuple[int, ...], Tuple[str, ...]]
    q: P                      # q [B?, S, H, D]; lse takes q's first dims
    indices: P                # indices [B?, S, HK, T]
    out: Optional[P] = None   # out_shardings (None: left to propagation)
    k: P = P()
    B: Optional[int] = 4
    S: int = 64
    H: int = 64
    T: int = 16
    HK: int = 1
    causal: bool = True
    k_stride: int = 1
    q_start: object = "batch"  # "batch": traced [B]; "scalar": traced []; or a Python int
    clean: bool = True         # no collective at all, only per-shard shapes
    gathers: str = ""          # for clean=False: which operand is gathered ("q", "k")


D, N = 16, 40
X8 = ((8,), ("x",))
XY24 = ((2, 4), ("x", "y"))
XY42 = ((4, 2), ("x", "y"))


def case_inputs(c: Case):
    if c.q_start == "batch":
        q_start = jnp.asarray(np.arange(c.B) * 5 - 4, jnp.int32)  # causal edge inside S
    elif c.q_start == "scalar":
        q_start = jnp.int32(-11)
    else:
        q_start = c.q_start
    q, k, idx, lse, kw = make_inputs(
        seed_of(c.name), S=c.S, H=c.H, D=D, N=N, T=c.T, B=c.B, HK=c.HK, dtype=jnp.float32,
        causal=c.causal, k_stride=c.k_stride, q_start_index=q_start,
    )
    del kw["q_start_index"]
    # Host arrays: jit places them (CPU devices, also on a GPU machine).
    q, k, idx, lse = (np.asarray(x) for x in (q, k, idx, lse))
    if not isinstance(q_start, int):
        q_start = np.asarray(q_start)
    return (q, k, idx, lse), q_start, kw


def unsharded(f, *args):
    """The reference: the same function, unsharded, on one CPU device."""
    with jax.default_device(jax.devices("cpu")[0]):
        return np.asarray(jax.jit(f)(*args))


def sharded_fn(kw, python_q_start=None):
    if python_q_start is not None:
        return lambda q, k, i, l: attn_dist(q, k, i, l, q_start_index=python_q_start, **kw)
    return lambda q, k, i, l, s: attn_dist(q, k, i, l, q_start_index=s, **kw)


def in_specs(c: Case, lse_rank: int):
    lse_spec = P(*tuple(c.q)[:lse_rank])
    return (c.q, c.k, c.indices, lse_spec)


def assert_same(out, ref):
    out = np.asarray(out)
    assert out.shape == ref.shape
    # sanity: the case is not trivial (some mass, some masked slots)
    assert (ref > 0).any() and (ref == 0).any()
    np.testing.assert_allclose(out, ref, rtol=1e-6, atol=1e-6 * float(np.abs(ref).max()))
