"""Walking jaxprs in the tests (a helper module, not a test module)."""

from __future__ import annotations

import jax


def iter_eqns(jaxpr, *, skip_fwd_bwd: bool = False):
    """Every equation of ``jaxpr``, each followed by those of the sub-jaxprs in
    its params (custom_vjp, jit, scan, ...), recursively. With
    ``skip_fwd_bwd``, params whose name contains "fwd" or "bwd" are not
    searched (a custom_vjp call also carries its forward rule as a jaxpr in
    newer jax: a second copy of the primal computation, not a second
    execution)."""
    for eqn in jaxpr.eqns:
        yield eqn
        for key, p in eqn.params.items():
            if skip_fwd_bwd and ("fwd" in key or "bwd" in key):
                continue
            for sub in p if isinstance(p, (tuple, list)) else (p,):
                inner = getattr(sub, "jaxpr", None)
                if inner is not None:
                    yield from iter_eqns(inner if hasattr(inner, "eqns") else inner.jaxpr, skip_fwd_bwd=skip_fwd_bwd)


def reductions(fn, *args):
    """The cross-device reductions in ``jax.jit(fn)``'s jaxpr, sorted: (kind,
    axes) with kind "psum" or "pmax" whatever jax calls the primitive
    (psum2, psum_invariant), looking into shard_map bodies (bare Jaxprs)."""
    def eqns(jaxpr):
        for eqn in jaxpr.eqns:
            yield eqn
            for sub in eqn.params.values():
                for body in sub if isinstance(sub, (tuple, list)) else (sub,):
                    body = body if hasattr(body, "eqns") else getattr(body, "jaxpr", None)
                    if body is not None:
                        yield from eqns(body if hasattr(body, "eqns") else body.jaxpr)

    found = []
    for eqn in eqns(jax.jit(fn).trace(*args).jaxpr.jaxpr):
        name = eqn.primitive.name
        if name.startswith(("psum", "pmax")):
            found.append(("psum" if name.startswith("psum") else "pmax", tuple(eqn.params["axes"])))
    return sorted(found)
