"""Context parallelism's layout inside the model: where a sequence is split over devices and
where it is whole (issue 15).

Under a training mesh with a 'context' axis larger than 1 (set with `jax.set_mesh`, as
`train.StepRunner` does), XLA's SPMD partitioner places every array of the step; these
constraints fix the layout at the points that decide what devices exchange:
  - the residual stream [B, T, dim] (`split_sequence`): the batch over 'data', the tokens over
    'context' in contiguous slices, so each device computes its own queries, window and FFN;
  - the compressed main KV and the index keys [B, S, d] (`whole_sequence`): whole on every
    device, one all-gather per KV source of S·d values (V4.1's MXFP4 index keys are 68 bytes a
    position), which the local queries score and attend to.
  - the sliding window: each device reads its own slice and the W − 1 rows before it, a halo
    from its left neighbour (XLA's partition of the whole-sequence pass; `window_rows` in the
    chunked one).
The attention computes masked entries too (no causal skipping), so contiguous slices give every
device the same work: no load-balancing permutation is needed.

Without such a mesh the constraints do nothing: one-device code is unchanged.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from v41jax.ops.attention import sliding_window_rows

DATA = "data"
"""The mesh axis that splits the batch."""
CONTEXT = "context"
"""The mesh axis that splits each sequence."""


def context_mesh():
    """The mesh in context (`jax.set_mesh`) if it splits sequences (a 'context' axis > 1), else
    None."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or CONTEXT not in mesh.axis_names or mesh.shape[CONTEXT] == 1:
        return None
    return mesh


def data_axis(mesh) -> str | None:
    """The mesh's batch axis ('data') if it has one, else None."""
    return DATA if DATA in mesh.axis_names else None


def shard_cache(cache, mesh: jax.sharding.Mesh):
    """`cache` (`nn.cache.Cache`) placed for sequence-sharded decode on `mesh`: the compressed
    main KV and index keys [B, S, row] split by position over 'context' in contiguous slices
    (and the batch over 'data' where the mesh has it), everything else (window rings,
    compressor buffers, lengths) split over 'data' only. Under `jax.set_mesh(mesh)`,
    `model.decode_step` then selects and attends where the rows live (`selection.select`,
    `ops.attention.sharded_packed_sparse_attention`)."""
    rows = PartitionSpec(data_axis(mesh))
    by_position = PartitionSpec(data_axis(mesh), CONTEXT)

    def place(x, spec):
        return None if x is None else jax.device_put(x, jax.sharding.NamedSharding(mesh, spec))

    layers = tuple(
        layer.replace(
            window=place(layer.window, rows),
            main_kv=place(layer.main_kv, by_position),
            index_k=place(layer.index_k, by_position),
            kv_state=place(layer.kv_state, rows),
            score_state=place(layer.score_state, rows),
        )
        for layer in cache.layers
    )
    return cache.replace(lengths=place(cache.lengths, rows), layers=layers)


def check_decode_implementation(implementation: str):
    """The mesh in context if the decode cache is sharded by position (a 'context' axis > 1),
    else None; ValueError unless `implementation` is 'xla' then (the kernels read one
    device's rows)."""
    mesh = context_mesh()
    if mesh is not None and implementation != "xla":
        raise ValueError(
            f"implementation: expected 'xla' on a cache sharded over context="
            f"{mesh.shape[CONTEXT]} (the kernels read one device's rows), got {implementation!r}"
        )
    return mesh


def _constrain(x, sequence_axis):
    mesh = context_mesh()
    if mesh is None:
        return x
    return jax.lax.with_sharding_constraint(
        x, PartitionSpec(data_axis(mesh), sequence_axis, *([None] * (x.ndim - 2)))
    )


def split_sequence(x: jax.Array) -> jax.Array:
    """`x` [B, T, ...] laid out with its batch over 'data' and its tokens over 'context'."""
    return _constrain(x, CONTEXT)


def whole_sequence(x: jax.Array) -> jax.Array:
    """`x` [B, S, ...] laid out with its batch over 'data' and every position on every device
    of the 'context' axis."""
    return _constrain(x, None)


def rowwise(fn, *args, whole=()):
    """`fn(*args, *whole)` for arrays `args` laid out [B, T, ...] whose rows (queries) are
    independent, run on each device's own rows under context parallelism (`jax.shard_map`),
    else as is; `whole` are arrays [B, S, ...] every device reads in full (keys), and an arg
    may be None.

    For the selections (top-k of the scores, the candidate pool): XLA partitions a sort along
    the split rows, but not `lax.top_k`, which it would run on all-gathered [B, T, S] scores.
    The result is the same either way; only where it is computed differs."""
    mesh = context_mesh()
    if mesh is None:
        return fn(*args, *whole)
    rows, keys = PartitionSpec(data_axis(mesh), CONTEXT), PartitionSpec(data_axis(mesh))
    specs = (rows,) * len(args) + (keys,) * len(whole)
    return jax.shard_map(fn, in_specs=specs, out_specs=rows)(*args, *whole)


def window_rows(window: jax.Array, window_size: int, positions: jax.Array):
    """`ops.attention.sliding_window_rows(window, window_size, positions)`: the window rows of
    the queries at `positions` [R]. Under context parallelism `window` [B, T, ...] is split
    over 'context' and `positions` holds each device's queries in device order (its own slice,
    or past its end for padding rows whose results are dropped): each device gathers from its
    own slice and the W − 1 rows before it, sent by its left neighbour (`lax.ppermute`, a
    halo), never the whole window."""
    mesh = context_mesh()
    if mesh is None:
        return sliding_window_rows(window, window_size, positions)
    n, seq = mesh.shape[CONTEXT], window.shape[1]
    local, halo = seq // n, window_size - 1
    if halo > local:
        raise ValueError(
            f"window: expected slices of at least window_size − 1 = {halo} positions, got "
            f"{local} ({seq} over context={n})"
        )

    def rows_of(w, pos):
        first = jax.lax.axis_index(CONTEXT) * local - halo  # the position of ext's row 0
        before = jax.lax.ppermute(w[:, local - halo :], CONTEXT, [(i, i + 1) for i in range(n - 1)])
        ext = jnp.concatenate([before, w], axis=1)  # device 0 receives zeros: positions < 0
        window_pos = pos[:, None] + jnp.arange(window_size) - halo
        rows = ext[:, jnp.clip(window_pos - first, 0, local + halo - 1)]
        valid = (window_pos >= 0) & (window_pos < seq)
        return rows, jnp.broadcast_to(valid, (w.shape[0], *valid.shape))

    split = PartitionSpec(data_axis(mesh), CONTEXT)
    return jax.shard_map(
        rows_of, in_specs=(split, PartitionSpec(CONTEXT)), out_specs=(split, split)
    )(window, positions)
