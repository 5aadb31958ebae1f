"""Timing and memory helpers of the benchmark (see bench.py for the method)."""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp


def log(msg: str) -> None:
    print(msg, flush=True)


def time_calls(fn, arg_sets, *, calls: int, samples: int, warmup: int = 3) -> float:
    """Median seconds per call."""
    for i in range(warmup):
        jax.block_until_ready(fn(*arg_sets[i % len(arg_sets)]))
    per_call = []
    for _ in range(samples):
        t0 = time.perf_counter()
        out = None
        for i in range(calls):
            out = fn(*arg_sets[i % len(arg_sets)])
        jax.block_until_ready(out)
        per_call.append((time.perf_counter() - t0) / calls)
    return statistics.median(per_call)


def extra_memory_bytes(jitted, *args) -> int | None:
    """Temporaries + output of one compiled call, as XLA accounts them."""
    try:
        m = jitted.lower(*args).compile().memory_analysis()
        return int(m.temp_size_in_bytes + m.output_size_in_bytes)
    except Exception:  # noqa: BLE001 - not every backend reports it
        return None


def gemm_problem(n: int = 8192, dtype=jnp.bfloat16):
    """The ceiling's dense n^3 matmul of ``dtype`` operands, float32
    accumulation (bf16, or float8_e4m3fn with a float32 result): (jitted,
    two input sets, FLOPs)."""
    ka, kb = jax.random.split(jax.random.key(1))
    a = jax.random.normal(ka, (n, n), jnp.float32).astype(dtype)
    b = jax.random.normal(kb, (n, n), jnp.float32).astype(dtype)
    if jnp.dtype(dtype) == jnp.dtype(jnp.bfloat16):
        mm = jax.jit(lambda x, y: x @ y)
    else:  # B K-major, as the float8 tensor cores take it
        mm = jax.jit(lambda x, y: jax.lax.dot_general(x, y, (((1,), (1,)), ((), ())),
                                                      preferred_element_type=jnp.float32))
    return mm, [(a, b), (b, a)], 2 * n**3


def gemm_ceiling(calls: int, samples: int, dtype=jnp.bfloat16) -> float:
    """TFLOP/s of a dense 8192^3 matmul of ``dtype`` on random data."""
    mm, sets, flops = gemm_problem(dtype=dtype)
    t = time_calls(mm, sets, calls=calls, samples=samples)
    return flops / t / 1e12


def time_pair(f_base, f_var, base_sets, var_sets, *, calls, samples):
    """(base seconds, variant seconds): each timed twice, interleaved, the
    faster kept (the two stay comparable through clock and thermal drift)."""
    tb, tv = [], []
    for _ in range(2):
        tb.append(time_calls(f_base, base_sets, calls=calls, samples=samples))
        tv.append(time_calls(f_var, var_sets, calls=calls, samples=samples))
    return min(tb), min(tv)
