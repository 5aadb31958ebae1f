"""Layers: whole computations composed from the op families of
``jax_attn_dist.ops``, with no primitive or kernel of their own.

A layer validates its arguments once, under its own name, with the ops'
contract checks, computes SPEC §6's row ranges once, and binds the ops'
canonical (custom-VJP) functions: the kernels, transformation rules and
gradients are the ops'. Imports run one way: public API -> layers -> ops.
"""
