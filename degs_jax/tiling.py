"""Static shapes for batch-independent numerics, with no model in sight: a function
over fixed tiles of rows (`row_tiled`) and one branch per static size (`switch_on_size`).
The transformer (`degs_jax.models`) and the samplers (generation, lens sums, SMC weights)
both use them; neither imports the other for it."""

from __future__ import annotations

import math
from typing import Optional, Sequence

import jax
import jax.numpy as jnp

Array = jax.Array


def row_tiled(fn, x, tile: Optional[int]):
    """fn over the rows of x, `tile` rows at a time (None: fn(x) at once). x: an array
    whose rows are all its axes but the last, or a tuple of arrays that share those
    leading axes (the first array's all-but-last, e.g. (residuals [B, T, D], positions
    [B, T])); fn maps tiles ([n, ...] each; a tuple for a tuple) to a pytree of [n, ...],
    row by row. Rows are padded with zeros to a multiple of `tile` and the tiles run in a
    `lax.map`, so fn is compiled for `tile` rows only: the same kernels, hence the same
    reduction orders, whatever the number of rows. At least two tiles run: a loop of one
    trip is inlined by XLA and fused with its neighbours (other numerics at one row,
    measured on CPU)."""
    if tile is None:
        return fn(x)
    arrays = x if isinstance(x, tuple) else (x,)
    lead = arrays[0].shape[:-1]
    n = math.prod(lead)
    pad = -n % tile + (tile if n <= tile else 0)  # >= 2 tiles: XLA inlines a 1-trip loop
    tiles = tuple(jnp.pad(a.reshape((n,) + a.shape[len(lead):]), [(0, pad)] + [(0, 0)] * (a.ndim - len(lead)))
                  .reshape((-1, tile) + a.shape[len(lead):]) for a in arrays)
    out = jax.lax.map(lambda t: fn(t if isinstance(x, tuple) else t[0]), tiles)
    return jax.tree.map(lambda o: o.reshape((-1,) + o.shape[2:])[:n].reshape(lead + o.shape[2:]), out)


def switch_on_size(sizes: Sequence[int], needed: Array, branch, *operands):
    """`branch(size)(*operands)` for the smallest of the increasing static `sizes` that is
    at least the traced `needed` (at most sizes[-1]), in one `lax.switch`."""
    index = jnp.searchsorted(jnp.asarray(sizes, jnp.int32), needed, side="left")
    return jax.lax.switch(index, [branch(size) for size in sizes], *operands)

