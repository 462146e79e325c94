"""Pieces shared by the GRPO trainer and the tuned-lens fit: micro-batching with fp32
gradient accumulation, and parameter dtype casts.

Micro-batches. A batch of B rows is cut into M = B / m micro-batches of m rows that
are run one after another inside one jitted `lax.scan`, their gradients summed in fp32:
memory holds one micro-batch's activations, and the result equals the whole batch's
gradient up to fp32 summation order, because every loss here is a *sum* over tokens
divided by a count fixed for the whole batch. Micro-batch k takes rows k, k + M, k + 2M,
... (a strided split): when the rows are split over the "data" axis of a mesh in
contiguous blocks, every device then holds m / n_data rows of every micro-batch, so all
devices work on every micro-batch (a contiguous split would put each micro-batch on
one device).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

Array = jax.Array


def split_micro_batches(x: Array, rows_per_micro: int) -> Array:
    """[B, ...] -> [M, m, ...] with m = rows_per_micro, micro-batch k = rows k, k + M, ..."""
    B = x.shape[0]
    if rows_per_micro < 1 or B % rows_per_micro:
        raise ValueError(f"micro-batch of {rows_per_micro} rows does not divide the batch of {B} rows")
    M = B // rows_per_micro
    return jnp.swapaxes(x.reshape((rows_per_micro, M) + x.shape[1:]), 0, 1)


def cast_tree(tree, dtype):
    """Every array leaf of `tree` cast to `dtype` (None fields stay None)."""
    return jax.tree.map(lambda x: x.astype(dtype), tree)


def accumulate_gradients(loss_fn: Callable, params, micro_batches, rows_per_micro: int):
    """Sum over micro-batches of `loss_fn(params, batch) -> (value, aux)` and its
    gradient, in one `lax.scan`.

    micro_batches: a pytree of [B, ...] arrays, split with :func:`split_micro_batches`.
    Gradients are taken with respect to `params` (any dtype) and summed in fp32; `aux`
    must be a pytree of scalars (summed in fp32). Returns (value, aux, grads).
    """
    stacked = jax.tree.map(lambda x: split_micro_batches(x, rows_per_micro), micro_batches)
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    f32 = lambda t: jax.tree.map(lambda x: x.astype(jnp.float32), t)

    def body(carry, batch):
        value, aux, grads = carry
        (v, a), g = grad_fn(params, batch)
        add = lambda x, y: jax.tree.map(jnp.add, x, y)
        return (value + v.astype(jnp.float32), add(aux, f32(a)), add(grads, f32(g))), None

    zeros_grads = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
    first = jax.tree.map(lambda x: x[0], stacked)
    aux_shape = jax.eval_shape(lambda: loss_fn(params, first)[1])
    zeros_aux = jax.tree.map(lambda s: jnp.zeros(s.shape, jnp.float32), aux_shape)
    (value, aux, grads), _ = jax.lax.scan(body, (jnp.zeros((), jnp.float32), zeros_aux, zeros_grads),
                                          stacked)
    return value, aux, grads
