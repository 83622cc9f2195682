"""Argument checks shared by the ops and the layers above them, so that every boundary reports a
bad input the same way: the argument's name, what was expected, what was received.

The `require_*` checks run at trace time and see shapes and dtypes only. Values cannot be checked
under jit: `check_finite` stages a checkify check instead (reported under `checkify.checkify`, as
`prefill(..., debug=True)` runs it; eagerly it raises), like the selection invariants of
`v41jax.ops.invariants`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify
from jaxtyping import Array, ArrayLike, Int


def require_dtype(name: str, x: Array, kind: str) -> None:
    """Raise ValueError unless `x` has a dtype of `kind` ('floating', 'integer' or 'bool')."""
    ok = {
        "floating": jnp.issubdtype(x.dtype, jnp.floating),
        "integer": jnp.issubdtype(x.dtype, jnp.integer),
        "bool": x.dtype == jnp.bool_,
    }[kind]
    if not ok:
        raise ValueError(f"{name}: expected a {kind} dtype, got {x.dtype}")


def require_min_ndim(name: str, x: Array, ndim: int, layout: str) -> None:
    if x.ndim < ndim:
        raise ValueError(f"{name}: expected shape {layout} (at least {ndim} dims), got {x.shape}")


def require_broadcast(name: str, shape: tuple[int, ...], target: tuple[int, ...]) -> None:
    """Raise ValueError unless `shape` broadcasts to exactly `target` (numpy rules)."""
    try:
        ok = np.broadcast_shapes(shape, target) == target
    except ValueError:
        ok = False
    if not ok:
        raise ValueError(f"{name}: expected a shape that broadcasts to {target}, got {shape}")


def require_nonnegative_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 0:
        raise ValueError(f"{name}: expected a non-negative Python int, got {value!r}")
    return int(value)


def require_positive_int(name: str, value: object) -> int:
    if require_nonnegative_int(name, value) == 0:
        raise ValueError(f"{name}: expected a positive Python int, got {value!r}")
    return int(value)


def as_lengths(name: str, lengths: ArrayLike, target: tuple[int, ...]) -> Int[Array, "*rows"]:
    """Integer per-row lengths broadcast to `target` (a Python int is one length for all rows);
    concrete lengths must be >= 0 (traced ones cannot be read)."""
    lengths = jnp.asarray(lengths)
    require_dtype(name, lengths, "integer")
    require_broadcast(name, lengths.shape, target)
    if not isinstance(lengths, jax.core.Tracer) and lengths.size and int(lengths.min()) < 0:
        raise ValueError(f"{name}: expected lengths >= 0, got {int(lengths.min())}")
    return jnp.broadcast_to(lengths, target)


def check_finite(x: ArrayLike, name: str = "x") -> None:
    """Stages a checkify check that every value of `x` is finite. Inside `checkify.checkify`
    (also under `jit`) a failure is reported in the returned error; eagerly it raises."""
    bad = ~jnp.isfinite(jnp.asarray(x))
    checkify.check(
        ~jnp.any(bad), f"{name}: expected finite values, got {{}} non-finite", jnp.sum(bad)
    )


def check_sequence_sharding(
    name: str,
    seq_name: str,
    shape: tuple[int, ...],
    block_size: int,
    mesh: jax.sharding.Mesh,
    axis: str,
    batch_axis: str | None,
) -> int:
    """The checks every sequence-sharded op runs on an array `name` of shape [B, S, ...] whose
    positions (the `seq_name` axis) are split over the mesh axis `axis` and rows over
    `batch_axis`: the axes exist, S splits into equal slices of whole blocks of `block_size`,
    B splits over `batch_axis`. Returns the positions per device, S / mesh.shape[axis]."""
    for arg, value in (("axis", axis), ("batch_axis", batch_axis)):
        if value is not None and value not in mesh.shape:
            raise ValueError(
                f"{arg}: expected one of the mesh axes {tuple(mesh.shape)}, got {value!r}"
            )
    n_dev = mesh.shape[axis]
    batch, n_pos = shape[:2]
    if n_pos % (block_size * n_dev):
        raise ValueError(
            f"{name}: expected {seq_name} to split into whole blocks over {n_dev} devices of "
            f"axis {axis!r} (a multiple of {block_size} · {n_dev} = {block_size * n_dev}), "
            f"got {n_pos}"
        )
    if batch_axis is not None and batch % mesh.shape[batch_axis]:
        raise ValueError(
            f"{name}: expected B divisible by the {mesh.shape[batch_axis]} devices of "
            f"batch_axis {batch_axis!r}, got B = {batch}"
        )
    return n_pos // n_dev
