"""Pooled indexer scoring on Hopper: a Mosaic GPU (Pallas `plgpu`) kernel (DESIGN §6.1).

What it computes is `v41jax.ops.pool.pooled_scores` for MXFP4 index keys of dim 128 (68-byte rows)
and blocks of 8 positions (`supports` says so to callers). How:

- One CTA (one warpgroup, Lane lowering semantics) owns `tiles_per_cta` tiles of one query; a
  tile is 8 pool blocks = 64 rows. Only those rows are read: each 8-row block is 544 contiguous
  bytes, fetched by two bulk copies (bytes 0..511 and 416..543: Pallas copies move multiples of
  128 bytes, so the two overlap by 96 bytes that land twice in shared memory with the same
  values). Each warp issues the copies of two blocks. Copies for the next `num_stages − 1` tiles
  are in flight while a tile is computed; −1 blocks are not fetched. A tile of 8 consecutive
  blocks starting at a block id that is a multiple of 4 (every full tile of the source scan)
  is one copy of 34 lines of 128 bytes instead (`TuningConfig.tile_copies`).
- Decode in registers (Hopper has no FP4 MMA): each 32-bit word holds 8 E2M1 nibbles; nibbles k
  and k+4 become one f16 pair with two shifts and masks (the f16 bits of e2m1·2⁻¹⁴, exact, the
  E2M1 subnormal included), times the f16 pair (2^(X_g − X + 14), same) in one f16x2 multiply,
  where X_g is the E8M0 code of the value's 32-group and X the row's largest:
  K' = e2m1·2^(X_g − X), exact. The row's scale 2^(X − 127) multiplies the row's score at the
  end (f32), so K' stays in f16 range whatever the scales. On the GPU the pairs are the wgmma
  operand's registers as they are (`_decode_registers`, through `plgpu.inline_mgpu`: Pallas
  cannot reinterpret a u32 array as f16 pairs), and each thread computes the 4 group factors of
  its rows once; before 2026-12-04 the decode split each pair into halves, repacked them across
  two words and computed a factor per word, 0.92 of the source scan's 2.55 ms at 1 M tokens
  (`results/tune_source_scan_h200_2026-12-04.json`, its no_decode variant).
- The decoded tile is the wgmma A operand straight from registers, q' (f16, in shared memory) the
  B operand: acc[64 rows, heads] = K'·q'ᵀ in f32 (swap-AB: the 64 key rows fill wgmma's M=64, the
  heads are N). Then ReLU, the head weights, the sum over heads, the row scale, the −inf mask, and
  a 256-byte store of the tile's 64 scores. q' = q/2^e_h per head (|q'| < 1) with w' = w·2^e_h
  (`kernel_queries`; exact since ReLU(2^e·x) = 2^e·ReLU(x)).
- `pooled_block_max_mgpu` (the source-scan route, issue 16 item 1) keeps a CTA's tile scores in
  shared memory instead of storing them, then reads them back as [blocks, 8] rows of a WGMMA
  layout (a block's 8 positions in the threads that hold its row), takes each row's max and
  stores the CTA's block maxima once: 4 bytes leave per 8 rows of 68 bytes read.
- `block_ids=None` (the source scan): every block of the cache, no ids read. A tile's ids are
  its position in the grid, its rows consecutive positions, and the tiles wholly past its
  row's length are emitted as −inf without a decode or a product, in a loop of their own after
  the live tiles', so a ragged batch costs its rows' lengths (2026-12-04: 1.36 against 2.37 ms
  at 1 M × 64, lengths spread over (0, S]; NOTES.md).
- The decode emits the 128 dims in the order its registers hold them (`COLUMN_DIMS`: a thread's
  f16 pair is nibbles k and k+4 of one word), so q is permuted the same way once per call
  (`permute_dims`): q·k is unchanged and no register shuffles are needed.

Numerics: exact products for MXFP4 q (its values are f16-exact after the per-head power of two,
unless a 32-group is ~20 binades below the head's largest value); other q are rounded to f16
(relative 2⁻¹¹). Accumulation is f32 in wgmma order. A key group more than 28 binades below its
row's largest scale flushes to zero; a row whose largest E8M0 code is 0 (2⁻¹²⁷, never produced by
`formats.pack`) scores 0; the NaN scale code 0xFF gives NaN scores like the reference.

Interpret mode (`interpret=True`, CPU tests) runs the same kernel with two substitutions the
interpreter forces: one copy per block (it cannot reshape refs, and has no 128-byte rule) and the
tile product as `jnp.dot` (its wgmma reads A only from shared memory).

Measured on the H200 (NOTES.md, `results/`): 55 µs for 64 queries × 16,384 pool positions, about
a third of the copy bandwidth; bound by instruction issue (copy issue, decode, per-tile epilogue),
not by HBM.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.mosaic import gpu as mgpu
from jax.experimental.mosaic.gpu import fragmented_array as mgpu_fa
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import arith, gpu, vector
from jaxtyping import Array, Float, Int, UInt8, UInt32

from pallas_kernels.dispatch import Support, support

BLOCK_SIZE = 8  # positions per candidate block (V4.1's candidate_block_size)
DIM = 128  # index head dim: a row is 64 nibble bytes + 4 E8M0 bytes = 17 words
ROW_WORDS = 17
BLOCK_WORDS = BLOCK_SIZE * ROW_WORDS  # 136 words = 544 bytes per block
TILE_BLOCKS = 8  # blocks per tile: 64 rows = wgmma's M
TILE_ROWS = TILE_BLOCKS * BLOCK_SIZE
HEAD_ALIGN = 32  # heads are padded to this (wgmma N % 8, and 128-byte copies of w)
MAX_HEADS = 256  # wgmma's N and a TMA box dimension
# A packed cache of a multiple of this many rows is read where it lies, by whole tiles: any other
# length is first copied into whole blocks of 8 (`packed_words`: the whole cache, at every call),
# and whole-tile copies need a whole number of 128-byte lines (blocks % 4 = 0).
IN_PLACE_ROWS = 4 * BLOCK_SIZE
# The two copies of one block: words [0, 128) and [104, 136) (multiples of 128 bytes each).
_COPIES = ((0, 128), (BLOCK_WORDS - 32, 32))
# A tile of 8 consecutive blocks is 4,352 bytes = 34 lines of 128 bytes (32 words); 4 blocks
# (2,176 bytes) = 17 lines, so a tile that starts at a block id ≡ 0 (mod 4) starts on a line.
_TILE_LINES = TILE_BLOCKS * BLOCK_WORDS // 32
# Bits of an f16 pair (two halves) that the sign and the E2M1 magnitude of a nibble go to.
_SIGN_BITS = np.uint32(0x80008000)
_MAGNITUDE_BITS = np.uint32(0x0E000E00)


def supports(
    *, fmt: str, dim: int, block_size: int, n_heads: int, score_dtype: str = "float32"
) -> Support:
    """Whether the kernel takes pooled scoring of `n_heads` queries of `dim` over packed `fmt`
    keys in blocks of `block_size`, with `score_dtype` scores: MXFP4 rows of dim 128 (68 bytes),
    blocks of 8, at most 256 heads, float32 scores (the bf16 roundings of
    `ops.scoring.index_scores(score_dtype='bfloat16')` fall between the head products and the
    head sum, inside the kernel: not implemented)."""
    return support(
        "the pooled-scoring Mosaic GPU kernel",
        (score_dtype == "float32", "score_dtype", "'float32'", score_dtype),
        (fmt == "mxfp4", "fmt", "'mxfp4'", fmt),
        (dim == DIM, "dim", str(DIM), dim),
        (block_size == BLOCK_SIZE, "block_size", str(BLOCK_SIZE), block_size),
        (n_heads <= MAX_HEADS, "n_heads", f"<= {MAX_HEADS}", n_heads),
    )


@dataclasses.dataclass(frozen=True)
class TuningConfig:
    """Tile sizes of the Mosaic GPU pooled-scoring kernel.

    Args:
      tiles_per_cta: 64-row tiles (8 blocks each) one CTA scores; a multiple of 4 (the block ids
        of a CTA are one copy of a multiple of 128 bytes). Fewer → more CTAs per query.
      num_stages: tiles whose rows are in flight or resident in shared memory (≥ 2).
      tile_copies: fetch a tile of 8 consecutive blocks (first id a multiple of 4) with one copy
        instead of 16 (taken when the cache holds a multiple of 4 blocks); False: always block
        by block (the measured v2).

    The default is the tuning the GPU tests ran with; pooled scoring runs `api.POOL_CONFIG`
    (16 × 2) and the source scan `SCAN_CONFIG` (32 × 2) by default, both measured (NOTES.md).
    """

    tiles_per_cta: int = 32
    num_stages: int = 4
    tile_copies: bool = True

    def __post_init__(self):
        if self.tiles_per_cta <= 0 or self.tiles_per_cta % 4:
            raise ValueError(
                f"tiles_per_cta: expected a positive multiple of 4, got {self.tiles_per_cta}"
            )
        if self.num_stages < 2:
            raise ValueError(f"num_stages: expected at least 2, got {self.num_stages}")


def _column_dims() -> np.ndarray:
    """The dim of a packed row (8w + n: nibble n of 32-bit word w) that each of the decoded
    tile's 128 columns holds.

    The wgmma A operand's layout (`plgpu.Layout.WGMMA`, f16) gives the thread with lane % 4 = j,
    in each 8-column tile c, the pair of columns 8c + 2j + (0, 1) as one 32-bit register; its
    words tile ([64, 16] u32, same layout) gives it words 8t + 2j + e (t, e ∈ {0, 1}). So column
    64t + 32e + 8k + 2j + p is nibble k + 4p of word 8t + 2j + e: the register of column tile
    8t + 4e + k is the word's nibbles (k, k + 4) as an f16 pair, built in place."""
    dims = np.empty(DIM, np.int32)
    for t, e, k, j, p in np.ndindex(2, 2, 4, 4, 2):
        dims[64 * t + 32 * e + 8 * k + 2 * j + p] = 8 * (8 * t + 2 * j + e) + k + 4 * p
    return dims


COLUMN_DIMS = _column_dims()
"""COLUMN_DIMS[c]: the row's dim in the decoded tile's column c (`_column_dims`)."""


def permute_dims(x: Float[Array, "*batch 128"]) -> Float[Array, "*batch 128"]:
    """Reorders the last axis (128 dims) into the decoded tile's column order: column c holds
    dim `COLUMN_DIMS[c]`."""
    return x[..., COLUMN_DIMS]


def packed_words(k_packed: UInt8[Array, "batch seq 68"]) -> UInt32[Array, "batch blocks 136"]:
    """The packed rows as little-endian 32-bit words grouped by block: [B, ceil(S/8), 136].

    A cache length that is not a multiple of 8 is padded with zero rows (this copies the cache;
    allocate caches in multiples of `IN_PLACE_ROWS` rows to avoid it, as `v41jax.nn.cache`
    does). The positions added are ≥ S, hence masked.
    """
    batch, n_pos, _ = k_packed.shape
    n_blocks = -(-n_pos // BLOCK_SIZE)
    if n_blocks * BLOCK_SIZE != n_pos:
        k_packed = jnp.pad(k_packed, ((0, 0), (0, n_blocks * BLOCK_SIZE - n_pos), (0, 0)))
    words = k_packed.reshape(batch, n_blocks, BLOCK_WORDS, 4)
    return lax.bitcast_convert_type(words, jnp.uint32)


def kernel_queries(
    q: Float[Array, "batch heads 128"], weights: Float[Array, "batch heads"]
) -> tuple[Float[Array, "batch heads_padded 128"], Float[Array, "batch heads_padded"]]:
    """q and the head weights as the kernel reads them: q in the tile's column order, divided by a
    power of two 2^e_h per head so that |q'| < 1 in f16, and w' = w·2^e_h (exact, since
    ReLU(2^e·x) = 2^e·ReLU(x)); heads zero-padded to a multiple of 32 (they score 0).

    q' is exact in f16 for MXFP4 q (e2m1 values times powers of two), unless a group of 32 dims
    is more than ~20 binades below the head's largest value; other q are rounded to f16.
    """
    n_heads = q.shape[1]
    q = q.astype(jnp.float32)
    _, exponent = jnp.frexp(jnp.max(jnp.abs(q), axis=-1))  # max|q| < 2^e (e = 0 for q = 0)
    q = jnp.ldexp(q, -exponent[..., None])
    weights = jnp.ldexp(weights.astype(jnp.float32), exponent)
    heads = -(-n_heads // HEAD_ALIGN) * HEAD_ALIGN
    q = jnp.pad(permute_dims(q), ((0, 0), (0, heads - n_heads), (0, 0)))
    weights = jnp.pad(weights, ((0, 0), (0, heads - n_heads)))
    return q.astype(jnp.float16), weights


def _decode_tile(words, scale_words):
    """Decodes a tile in jnp (the interpreter's path): f16 keys K' [64, 128] (columns in
    `COLUMN_DIMS` order) and the row exponents [64].

    words: [64, 16] uint32, the 64 nibble bytes of each row; scale_words: [64] uint32, the 4 E8M0
    bytes of each row (byte g scales words 4g..4g+3). With X_g the code of a value's group and X the
    row's largest code, K' = e2m1 · 2^(X_g − X), so that k = K' · 2^(X − 127): factoring the row's
    scale out keeps K' in f16 range whatever the scales (groups more than 28 binades below the
    row's largest flush to zero). Returns (K', X).
    """
    row_code = _row_code(scale_words)
    column = plgpu.broadcasted_iota(jnp.uint32, words.shape, 1, layout=plgpu.Layout.WGMMA)
    code = (lax.broadcast_in_dim(scale_words, words.shape, (0,)) >> ((column >> 2) << 3)) & 0xFF
    # f16 2^(X_g − X + 14) (the decoded pairs below carry a factor 2^-14): exponent field
    # X_g − X + 29, or 0 (flush) for groups that far below the row's largest.
    field = code.astype(jnp.int32) + 29 - lax.broadcast_in_dim(row_code, words.shape, (0,))
    field = jnp.maximum(field.astype(jnp.int32), 0)
    multiplier = lax.bitcast_convert_type((field << 10).astype(jnp.uint16), jnp.float16)
    pieces = [None] * 8
    for k in range(4):
        # Nibbles k and k + 4 of each word as an f16 pair: sign (nibble bit 3) to bit 15, the
        # three magnitude bits to bits 9..11, i.e. the f16 bits of e2m1 · 2^-14 (exact, the E2M1
        # subnormal 0.5 becoming an f16 subnormal).
        sign = (words << (12 - 4 * k)) & _SIGN_BITS
        magnitude = (words << (9 - 4 * k) if k < 3 else words >> 3) & _MAGNITUDE_BITS
        bits = sign | magnitude
        for nibble, half in ((k, bits), (k + 4, bits >> 16)):
            value = lax.bitcast_convert_type(half.astype(jnp.uint16), jnp.float16)
            pieces[nibble] = value * multiplier  # exact: a power of two times e2m1
    # pieces[4p + k][r, 8t + 2j + e] → column 64t + 32e + 8k + 2j + p (`_column_dims`).
    keys = jnp.stack(pieces).reshape(2, 4, TILE_ROWS, 2, 4, 2)  # p, k, r, t, j, e
    keys = keys.transpose(2, 3, 5, 1, 4, 0).reshape(TILE_ROWS, DIM)  # r, t, e, k, j, p
    return keys, row_code


def _row_code(scale_words):
    """The row's largest E8M0 code X, from its 4 scale bytes (one u32 per row)."""
    return functools.reduce(jnp.maximum, [(scale_words >> (8 * g)) & 0xFF for g in range(4)])


@plgpu.inline_mgpu(
    arg_types=(plgpu.Layout.WGMMA, plgpu.Layout.WGMMA.reduce(1), plgpu.Layout.WGMMA.reduce(1)),
    return_type=plgpu.ShapeDtypeStruct((TILE_ROWS, DIM), jnp.float16, plgpu.Layout.WGMMA),
)
def _decode_registers(ctx, words, scale_words, row_code):
    """The GPU's decode: `_decode_tile`'s keys (same values, same columns), built register by
    register. words: [64, 16] u32 (WGMMA layout: a thread holds words 8t + 2j + e, t, e ∈ {0, 1},
    j = lane % 4, of rows r and r + 8); scale_words, row_code: [64] u32 (one per row). Each
    thread computes the group factor of its (row, t) once: the words 8t + 2j, 8t + 2j + 1 lie in
    group 2t + j // 2. Each word gives 4 registers of the A operand (`_column_dims`)."""
    del ctx
    i32 = ir.IntegerType.get_signless(32)
    f16x2 = ir.VectorType.get((2,), ir.F16Type.get())

    def const(value):
        return arith.constant(i32, int(value))

    tid = arith.index_cast(i32, gpu.thread_id(gpu.Dimension.x))
    # Bit offset of the thread's first group byte: 8 · (j // 2), j = lane % 4.
    group_shift = arith.shli(arith.andi(arith.shrui(tid, const(1)), const(1)), const(3))
    out = np.empty(mgpu_fa.WGMMA_LAYOUT.registers_shape((TILE_ROWS, DIM)), dtype=object)

    def element(register, i):
        return vector.extract(register, dynamic_position=[], static_position=[i])

    for h in range(2):  # rows r and r + 8 of the thread's 16-row slab
        scales = element(scale_words.registers[0, 0, h, 0, 0], 0)
        largest = element(row_code.registers[0, 0, h, 0, 0], 0)
        for t in range(2):
            shift = arith.addi(group_shift, const(16 * t))
            code = arith.andi(arith.shrui(scales, shift), const(0xFF))
            # f16 2^(X_g − X + 14) in both halves: exponent field X_g − X + 29, or 0 (flush).
            field = arith.maxsi(arith.subi(arith.addi(code, const(29)), largest), const(0))
            half = arith.shli(field, const(10))
            factor = mgpu_utils.bitcast(arith.ori(half, arith.shli(half, const(16))), f16x2)
            pair_of_words = words.registers[0, t, 0, 0, h, 0, 0, 0, 0]
            for e in range(2):
                word = element(pair_of_words, e)
                for k in range(4):
                    # Nibbles k and k + 4: sign (bit 4k + 3) to bits 15 and 31, the magnitude
                    # bits to 9..11 and 25..27 (`_decode_tile`).
                    sign = arith.andi(arith.shli(word, const(12 - 4 * k)), const(_SIGN_BITS))
                    if k < 3:
                        magnitude = arith.shli(word, const(9 - 4 * k))
                    else:
                        magnitude = arith.shrui(word, const(3))
                    magnitude = arith.andi(magnitude, const(_MAGNITUDE_BITS))
                    pair = mgpu_utils.bitcast(arith.ori(sign, magnitude), f16x2)
                    out[0, 8 * t + 4 * e + k, 0, 0, h, 0, 0, 0, 0] = arith.mulf(pair, factor)
    return mgpu.FragmentedArray(_registers=out, _layout=mgpu_fa.WGMMA_LAYOUT, _is_signed=None)


def _kernel(
    k_hbm,
    k_tiles_hbm,
    q_hbm,
    meta_hbm,
    ids_hbm,
    out_hbm,
    k_smem,
    q_smem,
    meta_smem,
    ids_smem,
    out_smem,
    k_barriers,
    meta_barrier,
    blocks_smem=None,
    *,
    n_tiles: int,
    num_stages: int,
    n_blocks: int,
    interpret: bool,
    ablation: str | None,
    block_max: bool,
    tile_copies: bool,
):
    b = lax.axis_index("batch")
    split = lax.axis_index("split")
    if ids_hbm is not None:
        plgpu.copy_gmem_to_smem(ids_hbm.at[b, split], ids_smem, meta_barrier)
    plgpu.copy_gmem_to_smem(q_hbm.at[b], q_smem, meta_barrier)
    plgpu.copy_gmem_to_smem(meta_hbm.at[b], meta_smem, meta_barrier)
    plgpu.barrier_wait(meta_barrier)
    heads = q_smem.shape[0]
    limit = meta_smem[heads]  # the weights' bits, then the limit (`_pooled`)

    whole_blocks = interpret
    copies_per_block = 1 if whole_blocks else len(_COPIES)

    if ids_hbm is None:
        # Every block of the cache (`every_block` without its ids): slot i of tile t is block
        # (split·n_tiles + t)·8 + i, listed while it holds a position < limit (−1 after).
        def first_block(tile):
            return (split * n_tiles + tile) * TILE_BLOCKS

        def block_id(tile, i):
            block = first_block(tile) + i
            return jnp.where(block * BLOCK_SIZE < limit, block, -1)

        def whole_tile(tile):
            """Whether the tile is 8 blocks of the cache holding visible positions (its first id
            is a multiple of 8), and that first id."""
            first = first_block(tile)
            # limit ≤ S: a block holding a position < limit lies in the cache.
            return (first + TILE_BLOCKS - 1) * BLOCK_SIZE < limit, first

    else:

        def block_id(tile, i):
            return ids_smem[tile, i]

        def whole_tile(tile):
            """Whether the tile's ids are 8 consecutive blocks in the cache from a multiple of 4,
            and its first id."""
            first = ids_smem[tile, 0]
            whole = (first >= 0) & (lax.rem(first, 4) == 0) & (first + TILE_BLOCKS <= n_blocks)
            for i in range(1, TILE_BLOCKS):
                whole = whole & (ids_smem[tile, i] == first + i)
            return whole, first

    def fetch_block(block, i, slot):
        """Starts the copy of block `block` into rows 8i..8i+7 of stage `slot`."""

        @pl.when(block >= 0)
        def _copy():
            # Ids beyond the cache are masked later; clamping keeps the read in bounds.
            src = jnp.minimum(block, n_blocks - 1)
            if whole_blocks:
                plgpu.copy_gmem_to_smem(
                    k_hbm.at[b, src],
                    k_smem.at[slot, pl.ds(i * BLOCK_SIZE, BLOCK_SIZE)],
                    k_barriers.at[slot],
                )
                return
            block_smem = k_smem.at[slot].reshape(TILE_BLOCKS, BLOCK_WORDS).at[i]
            for start, size in _COPIES:
                plgpu.copy_gmem_to_smem(
                    k_hbm.at[b, src, pl.ds(start, size)],
                    block_smem.at[pl.ds(start, size)],
                    k_barriers.at[slot],
                    oob_mode=plgpu.OOBFillMode.PROMISE_IN_BOUNDS,
                )

        @pl.when(block < 0)
        def _skip():
            # A −1 block is not read; its rows are masked. Arrive as its copies would.
            for _ in range(copies_per_block):
                plgpu.barrier_arrive(k_barriers.at[slot])

    def fetch_tile(first, slot):
        """Starts one copy of blocks first … first + 7 (in the cache, first % 4 = 0) into stage
        `slot`: 4,352 contiguous bytes, 34 rows of 128 bytes of `k_tiles_hbm` (the
        interpreter: 64 rows of 68 bytes, as it has no 128-byte rule and cannot reshape)."""
        if whole_blocks:
            src = k_tiles_hbm.at[b, pl.ds(first * BLOCK_SIZE, TILE_ROWS)]
            plgpu.copy_gmem_to_smem(src, k_smem.at[slot], k_barriers.at[slot])
            return
        src = k_tiles_hbm.at[b, pl.ds(lax.div(first, 4) * (4 * BLOCK_WORDS // 32), _TILE_LINES)]
        plgpu.copy_gmem_to_smem(
            src,
            k_smem.at[slot].reshape(_TILE_LINES, 32),
            k_barriers.at[slot],
            oob_mode=plgpu.OOBFillMode.PROMISE_IN_BOUNDS,
        )

    def fetch(tile, slot):
        """Starts the copies of the tile's 8 blocks into stage `slot`.

        On the GPU a block is two overlapping copies (see the module docstring); the interpreter
        has no 128-byte rule but cannot reshape refs, so there (`whole_blocks`) it is one copy.
        Each warp issues the copies of two blocks: issued by the whole warpgroup, every copy
        would cost a warpgroup barrier and the address arithmetic in all 128 threads.

        A tile of 8 consecutive blocks in the cache whose first id is a multiple of 4 (every
        full tile of the source scan, and such runs in a pool) is one copy instead (`tile_copies`,
        `fetch_tile`), issued by warp 0; the other warps arrive for the copies it replaces.
        """
        if tile_copies:
            whole, first = whole_tile(tile)

        def per_warp(warp):
            def by_block():
                for i in range(TILE_BLOCKS):
                    pl.when(warp == i * 4 // TILE_BLOCKS)(
                        functools.partial(fetch_block, block_id(tile, i), i, slot)
                    )

            if not tile_copies:
                by_block()
                return

            @pl.when(whole)
            def _one_copy():
                pl.when(warp == 0)(functools.partial(fetch_tile, first, slot))
                for j in range(TILE_BLOCKS * copies_per_block // 4):
                    if j == 0:  # warp 0's copy stands for its first arrival
                        pl.when(warp != 0)(lambda: plgpu.barrier_arrive(k_barriers.at[slot]))
                    else:
                        plgpu.barrier_arrive(k_barriers.at[slot])

            pl.when(~whole)(by_block)

        plgpu.warp_map(per_warp)

    for stage in range(min(num_stages, n_tiles)):
        fetch(stage, stage)

    weights = plgpu.load(meta_smem.at[pl.ds(0, heads)], layout=plgpu.Layout.WGMMA.reduce(0))
    weights = lax.bitcast_convert_type(weights, jnp.float32)
    row = plgpu.broadcasted_iota(jnp.int32, (TILE_ROWS,), 0, layout=plgpu.Layout.WGMMA.reduce(1))

    def refill(tile, slot):
        """Starts the copies of tile `tile + num_stages` into `slot`, once the tile in it has
        been read."""

        @pl.when(tile + num_stages < n_tiles)
        def _():
            if ablation != "no_fetch":
                # The refill's bulk copies write this stage through the async proxy; the loads
                # before it read it through the generic one. A warpgroup barrier (the one
                # before `warp_map`) orders threads, not proxies: the proxy fence orders the
                # loads before the copies (PTX memory model; the interpreter's race detector
                # reports the refill as a race without it).
                plgpu.commit_smem()
                fetch(tile + num_stages, slot)

    def emit(tile, scores):
        """The tile's 64 masked scores, kept in shared memory: stored (or reduced by block,
        then stored) after the CTA's last tile, in one copy. A copy per tile cost a wait, a
        proxy fence and a copy issue in every tile's path."""
        out_smem[tile] = scores

    def score_tile(tile, slot):
        """Reads the tile's rows from `slot`, refills the slot, scores the rows and emits."""
        rows = k_smem.at[slot]
        # 68-byte rows: 4-byte loads only (no wider vectors, no ldmatrix), and some bank
        # conflicts that no 17-word row pitch avoids (`optimized=False` accepts them). The
        # cast to the wgmma layout only pairs registers.
        words = plgpu.load(
            rows.at[:, pl.ds(0, 16)], layout=plgpu.Layout._WGMMA_ACC_32BIT, optimized=False
        )
        words = plgpu.layout_cast(words, plgpu.Layout.WGMMA)
        scale_words = plgpu.load(
            rows.at[:, 16], layout=plgpu.Layout.WGMMA.reduce(1), optimized=False
        )
        refill(tile, slot)

        if whole_blocks:
            keys, row_code = _decode_tile(words, scale_words)
        else:
            row_code = _row_code(scale_words)
            keys = _decode_registers(words, scale_words, row_code)
        if ablation == "no_decode":  # the raw words as keys: the decode drops out
            raw = lax.bitcast_convert_type((words & 0x3FFF).astype(jnp.uint16), jnp.float16)
            keys = jnp.concatenate([raw] * 8, axis=1)
            row_code = (scale_words & 1) | 126

        if whole_blocks:
            # The interpreter's wgmma takes A only from shared memory: same product, jnp.dot.
            logits = jnp.dot(
                keys.astype(jnp.float32),
                q_smem[...].astype(jnp.float32).T,
                precision=lax.Precision.HIGHEST,
            )
        else:

            def mma(acc_ref):
                plgpu.wgmma(acc_ref, keys, q_smem.transpose((1, 0)))
                return acc_ref[...]

            logits = pl.run_scoped(mma, plgpu.ACC((TILE_ROWS, q_smem.shape[0]), jnp.float32))
        head_weights = lax.broadcast_in_dim(weights, logits.shape, (1,))
        scores = jnp.sum(jnp.maximum(logits, 0.0) * head_weights, axis=1)
        # The row's scale 2^(X − 127), exact in f32 (X = 0, never packed, flushes; 0xFF is NaN).
        row_scale = lax.bitcast_convert_type(row_code << 23, jnp.float32)
        scores = jnp.where(row_code == 0xFF, jnp.nan, scores * row_scale)

        if ids_hbm is None:  # every block: the tile's rows are consecutive positions
            pos = first_block(tile) * BLOCK_SIZE + row
            visible = pos < limit
        else:
            # Position of each row: block id of its slot (8 scalars, selected per row) · 8 + offset.
            block = jnp.full_like(row, ids_smem[tile, 0])
            for i in range(1, TILE_BLOCKS):
                block = jnp.where(row // BLOCK_SIZE == i, ids_smem[tile, i], block)
            pos = block * BLOCK_SIZE + row % BLOCK_SIZE
            visible = (block >= 0) & (pos < limit)
        if block_max:
            # NaN (a 0xFF scale) is no valid score for a block, as in `ops.pool.block_max`.
            visible = visible & (scores == scores)
        emit(tile, jnp.where(visible, scores, -jnp.inf))

    def arrived(tile):
        """Waits for the tile's copies; returns its stage."""
        slot = lax.rem(tile, num_stages)
        if ablation == "no_fetch":  # only the prologue's copies arrive
            pl.when(tile < num_stages)(lambda: plgpu.barrier_wait(k_barriers.at[slot]))
        else:
            plgpu.barrier_wait(k_barriers.at[slot])
        return slot

    # Every block: the tiles past the row's length (no row fetched, every score −inf) are not
    # decoded or multiplied, so a short row of a batch costs its own length, not the cache's.
    # The CTA's live tiles come first (tile t is live while its first position is < limit):
    # one loop over them, then one over the rest, so the hot loop holds no branch (a branch
    # per tile cost a full-length batch 2.5 % on the H200, BENCHMARKS.md 2026-12-04).
    if ids_hbm is None:
        n_live = jnp.clip(lax.div(limit + TILE_ROWS - 1, TILE_ROWS) - split * n_tiles, 0, n_tiles)
    else:
        n_live = n_tiles

    @pl.loop(0, n_live)
    def _tile(tile):
        score_tile(tile, arrived(tile))

    if ids_hbm is None:

        @pl.loop(n_live, n_tiles)
        def _past_the_row(tile):
            slot = arrived(tile)
            refill(tile, slot)
            emit(tile, jnp.where(row >= 0, -jnp.inf, 0.0))  # −inf in the rows' layout

    if block_max:
        # Row r of the CTA's scores viewed as [n_tiles·8, 8] is block r's 8 positions (a tile's
        # 64 rows are its 8 blocks in order), so a max along the rows' minor axis reduces every
        # block inside the threads that hold it (a WGMMA layout: rows over warps, no shared
        # memory for the reduction). One store of n_tiles·8 block maxima per CTA.
        plgpu.commit_smem()  # the tiles' stores, by every thread, before the loads
        n_rows = n_tiles * TILE_BLOCKS
        if interpret:  # the interpreter cannot reshape refs; the values can
            by_block = out_smem[...].reshape(n_rows, BLOCK_SIZE)
        else:
            by_block = plgpu.load(
                out_smem.reshape(n_rows, BLOCK_SIZE), layout=plgpu.Layout.WGMMA, optimized=False
            )
        blocks_smem[...] = jnp.max(by_block, axis=1)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(blocks_smem, out_hbm.at[b, split])
    else:  # the CTA's scores, one copy
        plgpu.commit_smem()  # the tiles' stores, by every thread, before the copy reads them
        plgpu.copy_smem_to_gmem(out_smem, out_hbm.at[b, split])
    plgpu.wait_smem_to_gmem(0)


def _every_block_kernel(
    k_hbm,
    k_tiles_hbm,
    q_hbm,
    meta_hbm,
    out_hbm,
    k_smem,
    q_smem,
    meta_smem,
    out_smem,
    k_barriers,
    meta_barrier,
    blocks_smem=None,
    **static,
):
    """`_kernel` over every block of the cache: no block ids in memory (`block_ids=None`)."""
    _kernel(
        k_hbm,
        k_tiles_hbm,
        q_hbm,
        meta_hbm,
        None,
        out_hbm,
        k_smem,
        q_smem,
        meta_smem,
        None,
        out_smem,
        k_barriers,
        meta_barrier,
        blocks_smem,
        **static,
    )


def pooled_scores_mgpu(
    k_packed: UInt8[Array, "batch seq 68"] | UInt32[Array, "batch blocks 136"],
    q: Float[Array, "batch heads 128"],
    weights: Float[Array, "batch heads"],
    block_ids: Int[Array, "batch n_blocks"] | None,
    lengths: Int[Array, " batch"],
    *,
    n_pos: int | None = None,
    config: TuningConfig = TuningConfig(),
    interpret: bool = False,
    _ablation: str | None = None,
) -> Float[Array, "batch n_pool"]:
    """Pool scores in block order, as `v41jax.ops.pool.pooled_scores` (fmt 'mxfp4', block_size 8,
    dim 128: `supports`).

    Args:
      k_packed: [B, S, 68] uint8 packed rows, or the same bytes as `packed_words` gives them
        ([B, ceil(S/8), 136] uint32; then `n_pos` = S is required).
      q: [B, H, 128] float queries; weights: [B, H] float; block_ids: [B, NB] int (−1 padded),
        or None: every block of the cache, NB = ceil(S/8) (what `source_scan.every_block`
        lists, without reading ids: each tile's rows are consecutive positions); lengths: [B]
        int.
      n_pos: S, when `k_packed` is given as words.
      config: tile sizes.
      interpret: run the Mosaic GPU interpreter (CPU) instead of compiling for the GPU.
      _ablation: a measurement aid (wrong results): 'no_fetch' computes every tile on the first
        stages' rows (no copies after the prologue), 'no_decode' moves the rows and runs the
        matmul and the epilogue on the raw words as keys. Timing both against the full kernel
        shows which part limits it (`bench.py`, NOTES.md).

    Returns:
      [B, NB·8] float32 scores; −inf for −1 blocks and positions ≥ lengths[b] or ≥ S.
    """
    return _pooled(
        k_packed,
        q,
        weights,
        block_ids,
        lengths,
        n_pos=n_pos,
        config=config,
        interpret=interpret,
        ablation=_ablation,
        block_max=False,
    )


def pooled_block_max_mgpu(
    k_packed: UInt8[Array, "batch seq 68"] | UInt32[Array, "batch blocks 136"],
    q: Float[Array, "batch heads 128"],
    weights: Float[Array, "batch heads"],
    block_ids: Int[Array, "batch n_blocks"] | None,
    lengths: Int[Array, " batch"],
    *,
    n_pos: int | None = None,
    config: TuningConfig = TuningConfig(),
    interpret: bool = False,
    _ablation: str | None = None,
) -> Float[Array, "batch n_blocks"]:
    """Each listed block's maximum score over its valid positions, the positions' scores never
    leaving the kernel: `pooled_scores_mgpu`'s scores (same arguments), NaN and positions
    ≥ lengths or ≥ S as −inf, reduced per block of 8 by max (`ops.pool.block_max`). −inf for a
    −1 block or one with no valid position. What the source-scan route ranks its blocks by.

    Tiles per CTA: `config.tiles_per_cta` rounded up to a multiple of 8 (a CTA's block maxima
    are reduced as rows of a WGMMA layout, whose tile is 64 rows). `_ablation`: as
    `pooled_scores_mgpu`'s (a measurement aid, wrong results).

    Returns:
      [B, NB] float32 block maxima, in the order of `block_ids`.
    """
    return _pooled(
        k_packed,
        q,
        weights,
        block_ids,
        lengths,
        n_pos=n_pos,
        config=config,
        interpret=interpret,
        ablation=_ablation,
        block_max=True,
    )


def _pooled(
    k_packed, q, weights, block_ids, lengths, *, n_pos, config, interpret, ablation, block_max
):
    """The kernel call behind `pooled_scores_mgpu` and `pooled_block_max_mgpu`."""
    if k_packed.dtype == jnp.uint8:
        n_pos = k_packed.shape[1]
        k_words = packed_words(k_packed)
    else:
        if n_pos is None:
            raise ValueError("n_pos: required when k_packed is given as uint32 words")
        k_words = k_packed
    batch, n_heads, dim = q.shape
    supported = supports(fmt="mxfp4", dim=dim, block_size=BLOCK_SIZE, n_heads=n_heads)
    if not supported:
        raise supported.error()
    if k_words.shape[2] != BLOCK_WORDS:
        raise ValueError(
            f"k_packed: expected words [B, blocks, {BLOCK_WORDS}], got {k_words.shape}"
        )
    if not 0 <= n_pos <= k_words.shape[1] * BLOCK_SIZE:
        # Past the words' blocks the kernel would read the last block again (it clamps).
        raise ValueError(
            f"n_pos: expected 0 … {k_words.shape[1] * BLOCK_SIZE} (the words' "
            f"{k_words.shape[1]} blocks of {BLOCK_SIZE}), got {n_pos}"
        )
    every_block = block_ids is None
    n_slots = -(-n_pos // BLOCK_SIZE) if every_block else block_ids.shape[1]
    n_tiles_total = -(-n_slots // TILE_BLOCKS)
    # A query's tiles are split over CTAs; a small pool gets fewer, smaller CTAs. The block
    # maxima of a CTA fill whole 64-row WGMMA tiles: 8 tiles of 8 blocks.
    multiple = 8 if block_max else 4
    tiles_per_cta = min(config.tiles_per_cta, -(-n_tiles_total // multiple) * multiple)
    tiles_per_cta = -(-tiles_per_cta // multiple) * multiple
    n_splits = -(-n_tiles_total // tiles_per_cta)
    padded_slots = n_splits * tiles_per_cta * TILE_BLOCKS
    if not every_block:
        ids = jnp.pad(
            jnp.asarray(block_ids, jnp.int32),
            ((0, 0), (0, padded_slots - n_slots)),
            constant_values=-1,
        ).reshape(batch, n_splits, tiles_per_cta, TILE_BLOCKS)
    q_kernel, w_kernel = kernel_queries(q, weights)
    heads = q_kernel.shape[1]
    limit = jnp.clip(jnp.asarray(lengths, jnp.int32), 0, n_pos)
    # One int32 row per query: the head weights' bits, then the limit on 32 words (a row a
    # whole number of 128 bytes): one copy into the kernel, and one small XLA op around it
    # where the weights and the limit's row were two.
    meta = jnp.concatenate(
        [
            lax.bitcast_convert_type(w_kernel, jnp.int32),
            jnp.broadcast_to(limit[:, None], (batch, 32)),
        ],
        axis=1,
    )

    num_stages = min(config.num_stages, tiles_per_cta)
    # Whole-tile copies need the cache as 128-byte lines: a whole number of them (blocks % 4 = 0).
    tile_copies = config.tile_copies and k_words.shape[1] % (IN_PLACE_ROWS // BLOCK_SIZE) == 0
    swizzle = 128
    q_transforms = (
        plgpu.TilingTransform((8, swizzle // 2)),
        plgpu.SwizzleTransform(swizzle),
    )
    # Every tile's scores stay in shared memory: stored once, or first reduced to the CTA's
    # block maxima.
    staging = [plgpu.SMEM((tiles_per_cta, TILE_ROWS), jnp.float32)]
    if block_max:
        out_type = (batch, n_splits, tiles_per_cta * TILE_BLOCKS)
        staging.append(plgpu.SMEM((tiles_per_cta * TILE_BLOCKS,), jnp.float32))
    else:
        out_type = (batch, n_splits, tiles_per_cta, TILE_ROWS)
    ids_scratch = [] if every_block else [plgpu.SMEM((tiles_per_cta, TILE_BLOCKS), jnp.int32)]
    kernel = plgpu.kernel(
        functools.partial(
            _every_block_kernel if every_block else _kernel,
            n_tiles=tiles_per_cta,
            num_stages=num_stages,
            n_blocks=k_words.shape[1],
            interpret=interpret,
            ablation=ablation,
            block_max=block_max,
            tile_copies=tile_copies,
        ),
        out_type=jax.ShapeDtypeStruct(out_type, jnp.float32),
        scratch_types=[
            plgpu.SMEM((num_stages, TILE_ROWS, ROW_WORDS), jnp.uint32),
            plgpu.SMEM((heads, DIM), jnp.float16, transforms=q_transforms),
            plgpu.SMEM((heads + 32,), jnp.int32),
            *ids_scratch,
            staging[0],
            plgpu.Barrier(
                num_arrivals=TILE_BLOCKS * (1 if interpret else len(_COPIES)),
                num_barriers=num_stages,
            ),
            plgpu.Barrier(num_arrivals=3 - every_block),  # the metadata's copies
            *staging[1:],
        ],
        grid=(batch, n_splits),
        grid_names=("batch", "split"),
        # Lane semantics: explicit register layouts (the decode picks them to avoid misaligned
        # vector loads from 68-byte rows) instead of the layout-inference pass.
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
        # The interpreter checks races and starts every buffer as NaN (unwritten outputs show).
        interpret=(
            plgpu.InterpretGPUParams(detect_races=True, uninitialized_memory="nan")
            if interpret
            else None
        ),
    )
    if interpret:
        k_tiles = k_words.reshape(batch, -1, ROW_WORDS)  # [B, blocks·8, 17]: rows
        k_words = k_words.reshape(batch, -1, BLOCK_SIZE, ROW_WORDS)
    elif tile_copies:
        k_tiles = k_words.reshape(batch, -1, 32)  # [B, blocks·17/4, 32]: 128-byte lines
    else:
        k_tiles = k_words  # not read
    ids_input = () if every_block else (ids,)
    out = kernel(k_words, k_tiles, q_kernel, meta, *ids_input)
    if block_max:
        return out.reshape(batch, padded_slots)[:, :n_slots]
    return out.reshape(batch, padded_slots * BLOCK_SIZE)[:, : n_slots * BLOCK_SIZE]
