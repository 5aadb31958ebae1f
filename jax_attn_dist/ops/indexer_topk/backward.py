"""indexer_topk has no backward pass (SPEC §9.4): the selected indices are
integers, piecewise constant in the inputs, so their derivative is zero
wherever it exists and the cotangents of the float inputs are zero.

:func:`detach` is how the op says so: the public function stops the
gradient of its float operands before binding the primitive, so ``jax.grad``
(and ``jax.jvp``) through a function that uses the indices works with
respect to every other input, and gives zeros with respect to
``index_q``, ``index_k``, ``weights`` and ``index_k_scale``. The primitive
itself never sees a tangent.
"""

from __future__ import annotations

import jax


def detach(*operands):
    """The operands under ``jax.lax.stop_gradient`` (integer operands carry
    float0 tangents already and are returned as they are)."""
    return tuple(x if jax.numpy.issubdtype(x.dtype, jax.numpy.integer) else jax.lax.stop_gradient(x)
                 for x in operands)
