"""FP4-dequant sparse attention on Hopper through Mosaic GPU (DESIGN §3 step 4, §6 kernel 2).

One CTA per (query, group of 64 heads, split) and two compute warpgroups. The 64 heads are the M
dimension of every wgmma (MQA: one latent shared by all heads); keys stream in chunks of 64: the
query's FP8 window rows first, then the compressed rows its top-k selects. Warpgroup w decodes
dims [w·D/2, (w+1)·D/2) of every chunk's keys and owns those dims of the output.

The default kernel (`TuningConfig(kernel='pipelined')`, `_pipelined_kernel`) keeps two key
tiles. Per chunk c:

1. the thread's packed words of top-k chunk c + 1 start towards it: at one or two splits
   copied with `cp.async` into its own slots of shared memory (Hopper has no TMA gather), so
   that no registers are held across the products (`gather='async'`); at more, loaded into
   registers (`gather_for`);
2. once both warpgroups have decoded chunk c (one mbarrier per tile), QK^T over the full D:
   where shared memory allows (`resolve_pipelined`), warpgroup w computes the logits of keys
   [32w, 32w + 32) (`qk='keys'`, two wgmma 64×32×D/2), else both compute all 64 keys' (two
   wgmma 64×64×D/2, `qk='heads'`);
3. the online softmax (log2 domain; the sink opens the running max and sum); with the keys
   split, the two warpgroups swap their row maxima and write P into one shared tile;
4. PV into the warpgroup's half of the output (wgmma 64×D/2×64, P from registers or, with the
   keys split, from the shared tile; K = V, so one tile serves both products), issued and not
   awaited: meanwhile each thread decodes its share of chunk c + 1,
   E2M1 × E4M3 (window: E4M3 × UE8M0) to bf16 in registers, and stores it into the other
   128-byte swizzled tile; a −1 slot is decoded from zeroed bytes, so it holds exact zeros.

`TuningConfig(kernel='exchange')` (the default until 2026-12-06) keeps one key tile: each
warpgroup decodes its half of D of a chunk (its words loaded behind the previous PV at one
split, `gather='behind_pv'`, else at the chunk's start, `gather='registers'`; `prefetch` and
`gather='async'` are other gathers), computes a partial QK^T over that half, and the two
partial logit tiles are summed through shared memory; then the softmax and PV, all one after
another. `TuningConfig(kernel='specialized')` is a warp-specialized variant (one or two producer
warpgroups decode into two key tiles while two consumers compute QK^T over the full D, or
over half the keys each with qk='keys'): correct, but slower on the H200 and on an H100, its
words staged or not (`NOTES.md`).

When the batch alone leaves SMs idle, each (query, head group) is split over up to 4 CTAs, each
taking a contiguous share of the chunks (split-KV); their bf16 partial outputs and log2-sum-exps
are merged by log-sum-exp: in the default kernel on the GPU at two splits inside the kernel, the
splits of a query running as one cluster (`TuningConfig.merge`, `_merge_splits`), else in XLA
(a cluster of four was 16 µs slower than XLA's merge at batch 32: `merges_in_kernel`). The output
is bf16 [B, H, D]; logits, softmax and accumulators are float32.

The decode is PTX inlined through `plgpu.inline_mgpu` (sm_90 has no FP4 and no E4M3→bf16
instruction): E2M1 nibbles go through three byte-permute (`prmt`) look-ups per 4 values; E4M3
bytes are placed in bf16's bit fields as value · 2⁻¹²⁰ (subnormals included) and rescaled; every
product is exact in bf16 (DESIGN §4). CPU interpret mode cannot run inline PTX, so there the same
kernel runs with `dequant='jnp'` (gather, then `v41jax.ops.formats.unpack`), and the PTX programs
are executed instruction by instruction in numpy by tests/test_sparse_attention_kernel.py, bit
for bit against `formats.unpack`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental.mosaic import gpu as mgpu
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import arith, builtin, gpu, llvm, memref, vector
from jaxtyping import Array, Float

from pallas_kernels.dispatch import Support, support
from v41jax.ops import formats

BLOCK_HEADS = 64  # wgmma M: the heads of one CTA
BLOCK_KV = 64  # keys per chunk
WARPGROUP = 128
_LOG2E = math.log2(math.e)
_TILE = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))  # bf16 [.., 64] tiles
_F32_TILE = (plgpu.TilingTransform((8, 32)), plgpu.SwizzleTransform(128))

# The decode is four self-contained PTX programs (operands $0.. outputs first, then inputs),
# used verbatim by the kernel and interpreted instruction by instruction in numpy by the tests.

# E2M1 nibble → bf16 look-up tables for `prmt` (8 entries, one byte each, indexed by the
# magnitude code 0..7): low bytes, high bytes, and high bytes with the sign bit set.
E2M1_LOW = (0xC0800000, 0xC0804000)
E2M1_HIGH = (0x3F3F3F00, 0x40404040)
E2M1_HIGH_NEG = (0xBFBFBF80, 0xC0C0C0C0)
BF16X2_2P120 = 0x7B807B80  # (2^120, 2^120): undoes the 2^-120 of the E4M3 bit placement
BF16X2_NEG_ZERO = 0x80008000  # fma addend that leaves x·y (and its sign of zero) unchanged

# One 32-bit word of 8 E2M1 nibbles (dims 8k..8k+7, element 2i in the low nibble of byte i) and
# a bf16x2 pair (s, s) → four bf16x2 words of value·s (exact: ≤ 6 significant bits, DESIGN §4).
# Per 4 nibbles: the magnitude codes index the low-byte and high-byte tables, the sign (bit 3)
# picks the negative high byte (selector nibble i or 4 + i), two byte interleaves finish.
E2M1_PTX = f"""{{
.reg .b32 c, ch, t, sl, sh, lb, hp, hn, hb, y, nz, l0, l1, h0, h1, n0, n1;
mov.b32 l0, {E2M1_LOW[0]:#x};
mov.b32 l1, {E2M1_LOW[1]:#x};
mov.b32 h0, {E2M1_HIGH[0]:#x};
mov.b32 h1, {E2M1_HIGH[1]:#x};
mov.b32 n0, {E2M1_HIGH_NEG[0]:#x};
mov.b32 n1, {E2M1_HIGH_NEG[1]:#x};
mov.b32 nz, {BF16X2_NEG_ZERO:#x};
and.b32 c, $4, 0x77777777;
shr.u32 ch, c, 16;
shr.u32 t, $4, 1;
and.b32 t, t, 0x44444444;
or.b32 sl, t, 0x32103210;
shr.u32 sh, sl, 16;
prmt.b32 lb, l0, l1, c;
prmt.b32 hp, h0, h1, c;
prmt.b32 hn, n0, n1, c;
prmt.b32 hb, hp, hn, sl;
prmt.b32 y, lb, hb, 0x5140;
fma.rn.bf16x2 $0, y, $5, nz;
prmt.b32 y, lb, hb, 0x7362;
fma.rn.bf16x2 $1, y, $5, nz;
prmt.b32 lb, l0, l1, ch;
prmt.b32 hp, h0, h1, ch;
prmt.b32 hn, n0, n1, ch;
prmt.b32 hb, hp, hn, sh;
prmt.b32 y, lb, hb, 0x5140;
fma.rn.bf16x2 $2, y, $5, nz;
prmt.b32 y, lb, hb, 0x7362;
fma.rn.bf16x2 $3, y, $5, nz;
}}"""


def _e4m3_lanes(dst: str, src: str) -> str:
    """PTX lines: two E4M3 bytes (one per 16-bit lane of `src`) → bf16x2 of value·2^-120 and then
    value (fma by 2^120). magnitude << 4 puts the exponent and mantissa into bf16's fields, so
    E4M3 subnormals land on bf16 subnormals (exact; bf16 fma keeps subnormals); the sign moves to
    bit 15; the NaN code (magnitude 0x7F) becomes a bf16 NaN (0x7FC0 or-ed in)."""
    return f"""and.b32 m, {src}, 0x007F007F;
shl.b32 r, m, 4;
and.b32 s, {src}, 0x00800080;
shl.b32 s, s, 8;
or.b32 r, r, s;
add.u32 s, m, 0x00010001;
and.b32 s, s, 0x00800080;
shr.u32 s, s, 7;
mul.lo.u32 s, s, 0x7FC0;
or.b32 r, r, s;
fma.rn.bf16x2 {dst}, r, p120, nz;
"""


_E4M3_PRELUDE = f""".reg .b32 m, r, s, z, x, v, p120, nz;
mov.b32 z, 0;
mov.b32 p120, {BF16X2_2P120:#x};
mov.b32 nz, {BF16X2_NEG_ZERO:#x};
"""

# Four E4M3 scale bytes → four bf16x2 pairs (s_i, s_i), one per 16-dim group.
E4M3_SCALES_PTX = (
    "{\n"
    + _E4M3_PRELUDE
    + "prmt.b32 x, $4, z, 0x4140;\n"
    + _e4m3_lanes("v", "x")
    + "prmt.b32 $0, v, v, 0x1010;\nprmt.b32 $1, v, v, 0x3232;\n"
    + "prmt.b32 x, $4, z, 0x4342;\n"
    + _e4m3_lanes("v", "x")
    + "prmt.b32 $2, v, v, 0x1010;\nprmt.b32 $3, v, v, 0x3232;\n}"
)

# Four E4M3 window bytes (dims 4j..4j+3) and a bf16x2 UE8M0 factor pair → two bf16x2 words.
E4M3_PTX = (
    "{\n"
    + _E4M3_PRELUDE
    + "prmt.b32 x, $2, z, 0x4140;\n"
    + _e4m3_lanes("v", "x")
    + "fma.rn.bf16x2 $0, v, $3, nz;\n"
    + "prmt.b32 x, $2, z, 0x4342;\n"
    + _e4m3_lanes("v", "x")
    + "fma.rn.bf16x2 $1, v, $3, nz;\n}"
)

# Two UE8M0 bytes (the low 16 bits of $2) → two bf16x2 factor pairs of 2^(E−127): the exponent
# field E itself; 0xFF (NaN) → NaN; 0x00 (2^-127, never written by `pack`; a zeroed −1 slot
# has it) → 0.
UE8M0_PTX = """{
.reg .b32 e, f;
.reg .pred nan;
and.b32 e, $2, 0xFF;
shl.b32 f, e, 7;
setp.eq.u32 nan, e, 255;
selp.b32 f, 0x7FC0, f, nan;
shl.b32 e, f, 16;
or.b32 $0, f, e;
shr.u32 e, $2, 8;
and.b32 e, e, 0xFF;
shl.b32 f, e, 7;
setp.eq.u32 nan, e, 255;
selp.b32 f, 0x7FC0, f, nan;
shl.b32 e, f, 16;
or.b32 $1, f, e;
}"""


# The staged gather (`TuningConfig(gather='async')`): a thread copies its own raw words of the
# next top-k chunk from HBM into its own slots of shared memory with `cp.async` (no registers
# held while the copies fly), and reads them back after waiting for its own copies only. A
# −1 slot copies 0 source bytes: `cp.async` fills the destination with zeros.
CP_ASYNC_16_PTX = "cp.async.cg.shared.global [$0], [$1], 16, $2;"
CP_ASYNC_4_PTX = "cp.async.ca.shared.global [$0], [$1], 4, $2;"
CP_ASYNC_COMMIT_PTX = "cp.async.commit_group;"
CP_ASYNC_WAIT_PTX = "cp.async.wait_group 0;"
LD_SHARED_V4_PTX = "ld.shared.v4.u32 {$0, $1, $2, $3}, [$4];"


HEAD_DIMS = (256, 512)
"""The head dims (D) the kernel takes: two warpgroups each hold D/2 columns in 64-wide tiles."""


def entry_registers(warpgroups: int) -> int:
    """The registers a thread of a CTA of `warpgroups` 128-thread warpgroups starts with, one
    CTA an SM (Mosaic GPU's PTX says `.minnctapersm 1`): 65,536 shared out, rounded down to the
    8 a warp's allocation comes in (168 for three warpgroups, 128 for four, as ptxas reports).
    The CTA's `setmaxnreg` pool holds these and no more."""
    return 65_536 // (128 * warpgroups) // 8 * 8


def supports(*, kv_fmt: str, window_fmt: str, dim: int) -> Support:
    """Whether the kernel takes attention over `kv_fmt` main-KV rows and `window_fmt` window
    rows of `dim` values: NVFP4 main KV, FP8 window, D in `HEAD_DIMS`. Any head count (padded
    to 64); keys as far as shared memory holds their slots, which a CTA keeps for every chunk
    of the window and the top-k: at D = 512 (any window), 48 chunks of 64 keys with the
    words staged by `cp.async` (a top-k of 2,944 beside a window of 128), 118 with them in
    registers (7,552). The default kernel stages them while they fit and loads them into
    registers beyond (`resolve_pipelined`); a gather that is set and does not fit is refused by
    Mosaic GPU while lowering, naming the bytes (`tests/test_kernel_lowering.py`)."""
    return support(
        "the FP4 sparse-attention Mosaic GPU kernel",
        (kv_fmt == "nvfp4", "kv_fmt", "'nvfp4'", kv_fmt),
        (window_fmt == "fp8", "window_fmt", "'fp8'", window_fmt),
        (dim in HEAD_DIMS, "dim", " or ".join(map(str, HEAD_DIMS)), dim),
    )


ABLATIONS = ("no_topk_rows", "no_topk_gather", "no_topk_decode")
"""`TuningConfig.ablation`'s measurement aids (wrong results, timings only)."""

KERNELS = ("exchange", "specialized", "pipelined")
"""`TuningConfig.kernel`: the kernel's structure (its docstring says each)."""

GATHERS = ("registers", "async", "behind_pv")
"""`TuningConfig.gather`: how a top-k chunk's packed rows reach the decode."""

MERGES = ("kernel", "xla")
"""`TuningConfig.merge`: where the partial outputs of split-KV are merged."""

MERGE_TILE = 64
"""`TuningConfig.merge_columns` comes in multiples of this: one 128-byte swizzle tile of bf16,
the unit a slice of the merge's swizzled [64, D/2] buffers keeps its layout in."""

SLOT_SOURCES = ("kernel", "xla")
"""`TuningConfig.slots`: where the key slots (row or −1 per key of each chunk) are made."""

QK_SPLITS = ("heads", "keys")
"""`TuningConfig.qk`: what the pipelined kernel's two warpgroups share out in QK^T."""


@dataclasses.dataclass(frozen=True)
class TuningConfig:
    """Knobs of the Mosaic GPU kernel.

    Args:
      dequant: 'ptx' decodes with inline PTX (the GPU path); 'jnp' gathers and unpacks with
        `v41jax.ops.formats.unpack` inside the kernel (the only one interpret mode can run).
      kernel: 'pipelined' (the default since 2026-12-06, eleventh session): `_pipelined_kernel`,
        two warpgroups and two key tiles; each decodes its half of the next chunk into the
        other tile while its PV of this one runs, and computes QK^T over the full D (no logit
        exchange, 1.5 times the tensor work). On an H100 (NOTES.md), with gather='async', its
        kernel took 25.9 µs against 27.6 for 'exchange' at batch 64 and 47.9 against 48.9 at
        128; with its words loaded into registers ('registers'), 26.9 and 51.7: ptxas moved
        those loads down to their use. On an H200 (twelfth session) it is faster than
        'exchange' at batch 64 (25.0 against 25.5 µs) but slower at 128 (46.1 against 45.0).
        'exchange' (the default before): `_exchange_kernel`,
        two warpgroups; each gathers and decodes its half of D of one key tile and computes
        QK^T over that half, the partial logits are summed through shared memory; all steps
        one after another. 'specialized':
        `_specialized_kernel`, a producer warpgroup gathers and decodes into two key tiles
        while two consumer warpgroups each compute QK^T over the full D, the softmax and PV.
        Slower on the H200 (2026-12-04, `NOTES.md`): kernel 33.4 µs against 26.2 at batch 64,
        64.5 against 50.4 at 128. GPU only: the interpreter does not finish three warpgroups
        on a 2-core CPU.
      prefetch: ('exchange' only) load the packed rows of the next top-k chunk while this
        one computes. Off by default: on the H200 (2026-11-29) it cost 1.6 µs at batch 64 and
        2.7 µs at 128, presumably through its 18 extra live registers (ptxas already reported
        255 registers and 152 bytes of spills with it). It had been timed, never tested: since
        2026-12-05 the interpreter checks it against the definition, and a GPU test (not yet
        run) does the same compiled.
      splits: CTAs per (query, 64 heads), each over a contiguous share of the key chunks, their
        partial outputs merged by log-sum-exp (split-KV, as flash-decoding; where: `merge`).
        None: as many as keep every SM busy (number of SMs // (B · head groups), at most 4),
        so a batch of 64 queries still fills the 132 SMs of an H200; 1 on CPU.
      gather: how a top-k chunk's packed rows reach the decode ('exchange'; 'pipelined' takes
        'registers' and 'async', its default at one or two splits; `_pipelined_kernel`).
        'registers': each thread loads its words from HBM when the chunk starts and waits for
        them.
        'async': each thread copies the next chunk's words into its own slots of shared memory
        with `cp.async` while this chunk's products run, and reads them back after waiting for
        its own copies only (no barrier: no thread reads another's words; no registers held
        across the products, unlike `prefetch`). 18 KB of staging at D = 512 (20 KB until
        the fifteenth session packed each thread's scale words side by side). Correct on the
        H200 (its 16 GPU tests), but no faster there: 32.8 µs against 32.7 at batch 64, 49.7
        against 49.1 at 128 (2026-12-04, NOTES.md). 'behind_pv': each thread loads the next
        top-k chunk's words into registers after this chunk's softmax, just before its PV, so
        the loads fly while PV runs and the registers are held during PV only (`prefetch`
        held them across the whole chunk and spilled); the window's chunks load the first
        top-k chunk's words the same way. On an H100 (2026-12-06, NOTES.md) it took the
        kernel from about 50.9 to 48.9 µs at batch 128 (one split: 10 chunks per CTA) in each
        of 5 runs, and cost 0.5 to 1.0 µs at batch 64 (two splits of 5 chunks) in each of 5.
        None (the default): 'behind_pv' where the call runs one split, else 'registers'
        (`gather_for`); 'registers' under an ablation, whose leave-one-outs were measured so.
        The specialized kernel takes 'registers' (its default) and 'async': its producer
        stages the next top-k chunk's words while it waits for a free key tile.
      q_overlap: ('exchange' only) wait for q's copy into shared memory only before the first
        QK^T, so that the first chunk's gather and decode run while q arrives (64 KB per CTA
        at D = 512; when every CTA starts at once, the q of a batch of 128 is 8 MB, about
        2 µs at the copy ceiling). Off: no faster on an H100 (2026-12-06, NOTES.md; 34.4
        against 34.3 µs at batch 64, 52.1 against 52.3 at 128), where the wait for q still
        held 6.5 % of the warp samples at batch 128 (Nsight Compute).
      merge: where the splits' partial outputs are merged, when a call runs more than one;
        None: 'kernel' for the pipelined kernel at two splits, else 'xla' (`merges_in_kernel`).
        'kernel' (`_merge_splits`): the splits of one (query, head group) run as one cluster
        of CTAs; each writes its bf16 partial output and log2-sum-exp, the cluster meets at a
        barrier, then warpgroup h of split h copies half h of every split's partial back (from
        L2, just written), merges them by log-sum-exp and writes that half of the output: no
        XLA op after the kernel. On an H100 at batch 64 (two splits) the kernel grew by 3.7 to
        4.1 µs and the whole call shrank by 0.4 to 1.0 µs (NOTES.md, 2026-12-06); at batch 32
        (four splits, a cluster of four) the whole call took 37.1 µs against 21.2 µs merged in
        XLA (H100, 2026-12-06, fourteenth session, two runs:
        `results/bench_sparse_attention_h100_2026-12-06_batch32_run{1,2}.json`), so the default
        merges in the kernel at two splits only. The specialized kernel merges so when told
        'kernel' (its two consumers, since 2026-12-08). GPU only: interpreted, a cluster's
        barrier deadlocked on a 2-core CPU, so interpret mode merges in XLA. 'xla' (the only
        one for the exchange kernel): `_combine_splits`, two XLA ops after the kernel (1.1 +
        3.2 µs at batch 64 on the H200, 2026-12-04).
      slots: where each query's key slots (the window row or top-k index of every key of a
        chunk, −1 to skip) are made; None: 'kernel' for the pipelined kernel, else 'xla'
        (`builds_slots`). 'kernel' (the pipelined kernel's default since 2026-12-06,
        thirteenth session; an option of the specialized kernel's since 2026-12-08, where all
        its warpgroups build them before they part into roles; on the GPU: interpret mode
        makes them in XLA): the CTA's threads build them from the window flags and the
        indices as given, in its prologue (`_slot_builder`), and no XLA op runs before the
        kernel. 'xla' (the only one for the exchange kernel): an XLA op before the kernel
        (1.6 to 1.8 µs on an H100), whose result the kernel copies in. The two give the same
        bits on every GPU case (`test_the_slots_built_in_the_kernel_are_xlas_gpu`, H100,
        2026-12-06); the whole call was 1.7 µs shorter at batch 64 and 1.8 µs at 128 on the
        H100 (NOTES.md), where the kernel itself did not change.
      qk: ('pipelined' only) how its two warpgroups share QK^T; None: 'keys', unless only
        'heads' leaves room for a preferred staged gather or the P tile does not fit
        (`resolve_pipelined`; at D = 512: past 12 chunks at one split, past 11 at two splits
        with their merge in the kernel).
        'heads': each computes the logits of all 64 keys over the full D, the same logits
        twice (1.5 times the exchange kernel's tensor work per chunk), and keeps P in
        registers for its PV.
        'keys' (`_SplitKeys.softmax`, fifteenth session): warpgroup w computes the logits of
        keys [32w, 32w + 32) only (a wgmma 64×32 per half of D: the tensor work of QK^T
        halved), the two swap their row maxima through shared memory, each writes its half
        of P (bf16) into a shared [64, 64] tile, and both run PV from that tile after a second
        barrier. 9 KB more shared memory: at D = 512 the staged gather fits beside 12 chunks
        of slots (top-640 and a window of 128). On an H100 (three runs, fifteenth session,
        NOTES.md), against 'heads' with the same gather: at batch 128 1.6 µs shorter staged
        and 1.6 registers; at 64 (two splits) +0.1 staged, −1.5 registers; at 32 and 40
        (four and three splits, registers) −0.5 and −0.7. At two splits merged in the kernel
        the row exchange goes through the merge's log-sum-exp stage, which lets batch 64 stage
        its words beside the P tile: −0.23 µs (−0.29 … −0.18) against 'heads' staged, two runs
        on an H100 (seventeenth session). The specialized kernel's two consumers split the
        keys the same way with qk='keys' (its default: 'heads', both computing every logit).
      ablation: a measurement aid ('exchange' only; wrong results). 'no_topk_rows' skips the
        gather and the decode of the top-k chunks, which then attend to whatever keys the
        tile last held (the window's chunks still run). 'no_topk_gather' decodes words made
        from the slot numbers instead of loading the rows; 'no_topk_decode' loads the rows
        and stores the raw words into the tile without decoding them (both need
        dequant='ptx': the interpreter's decode has neither step to leave out). Timed against
        the full kernel (`bench.py --variants ...`), they say what the top-k rows' gather and
        decode cost, together and apart (NOTES.md).
      merge_columns: with the merge in the kernel, the output columns `_merge_splits` merges
        in a pass of a loop: a multiple of `MERGE_TILE` (64, one 128-byte swizzle tile of
        bf16) that divides D/2. None: all D/2 at once, as straight-line code that each warp
        runs once (about 1,700 of the batch-64 program's 5,704 SASS instructions with the
        output's stores, where 803 of its 862 `no_inst` samples fell: Nsight Compute, H100,
        eighteenth session). 64, the default since the twentieth session: a loop of four
        passes at D = 512, a shorter program (`tests/test_kernel_lowering.py`) with the same
        bits (`test_the_merge_loop_is_the_unrolled_merge_bit_for_bit_gpu`), faster at batch 64
        in each of four paired runs on an H100 by 0.20 µs of 28.68 (NOTES.md; `bench.py
        --variants merge_unrolled` times the unrolled merge).
      producers: ('specialized' only) its producer warpgroups: 1 decodes both halves of D of
        every chunk; 2 decode one half each (four warpgroups, `SPECIALIZED_REGISTERS`), whose
        consumers issue PV as wgmmas of `PV_COLUMNS` columns (one of D/2 columns needs more
        registers than four warpgroups start with: refused by ptxas at D = 512 on an H100,
        2026-12-07; NOTES.md).
      registers: ('specialized' only) the per-thread registers (consumers, producers) each
        role asks for with `setmaxnreg`, multiples of 8 in [24, 256] whose sum over the
        warpgroups is at most what they start with together (`entry_registers`: 3 × 168 =
        504 for three, 4 × 128 = 512 for four): an `inc` takes registers only from those its
        own CTA's `dec`s released, and waits for them forever otherwise (at 208 / 96, 512 of
        504, the benchmark hung on an H100, 2026-12-08). None: `SPECIALIZED_REGISTERS`.
        ptxas spills the one producer's decode at 56 registers and not at 104 or more
        (NOTES.md).
    """

    dequant: str = "ptx"
    kernel: str = "pipelined"
    prefetch: bool = False
    gather: str | None = None
    splits: int | None = None
    q_overlap: bool = False
    merge: str | None = None
    slots: str | None = None
    qk: str | None = None
    ablation: str | None = None
    merge_columns: int | None = MERGE_TILE
    producers: int = 1
    registers: tuple[int, int] | None = None

    def __post_init__(self):
        if self.producers not in (1, 2):
            raise ValueError(f"producers: expected 1 or 2, got {self.producers!r}")
        if self.registers is not None:
            if self.kernel != "specialized":
                raise ValueError(
                    f"registers: only with kernel='specialized', got kernel={self.kernel!r}"
                )
            if (
                not isinstance(self.registers, tuple)
                or len(self.registers) != 2
                or any(
                    not isinstance(n, int) or n % 8 or not 24 <= n <= 256 for n in self.registers
                )
            ):
                raise ValueError(
                    "registers: expected a tuple (consumers, producers) of multiples of 8 in "
                    f"[24, 256], got {self.registers!r}"
                )
            consumers, producers = self.registers
            warpgroups = 2 + self.producers
            pool = warpgroups * entry_registers(warpgroups)
            if 2 * consumers + self.producers * producers > pool:
                raise ValueError(
                    f"registers: 2 consumer and {self.producers} producer warpgroups at "
                    f"{self.registers} ask for {2 * consumers + self.producers * producers} "
                    f"registers a thread summed over the warpgroups, expected at most {pool} "
                    f"({warpgroups} × the {entry_registers(warpgroups)} each starts with: "
                    "setmaxnreg.inc waits for what the CTA's own warpgroups released, forever "
                    "if they released too little)"
                )
        if self.producers == 2 and self.kernel != "specialized":
            raise ValueError(
                f"producers: 2 only with kernel='specialized', got kernel={self.kernel!r}"
            )
        if self.qk not in (None, *QK_SPLITS):
            raise ValueError(f"qk: expected None or one of {QK_SPLITS}, got {self.qk!r}")
        if self.qk == "keys" and self.kernel not in ("pipelined", "specialized"):
            raise ValueError(
                f"qk: 'keys' only with kernel='pipelined' or 'specialized', got "
                f"kernel={self.kernel!r}"
            )
        if self.slots not in (None, *SLOT_SOURCES):
            raise ValueError(f"slots: expected None or one of {SLOT_SOURCES}, got {self.slots!r}")
        if self.slots == "kernel" and self.kernel not in ("pipelined", "specialized"):
            raise ValueError(
                "slots: 'kernel' only with kernel='pipelined' or 'specialized', got "
                f"kernel={self.kernel!r}"
            )
        if self.merge not in (None, *MERGES):
            raise ValueError(f"merge: expected None or one of {MERGES}, got {self.merge!r}")
        if self.merge == "kernel" and self.kernel not in ("pipelined", "specialized"):
            raise ValueError(
                "merge: 'kernel' only with kernel='pipelined' or 'specialized', got "
                f"kernel={self.kernel!r}"
            )
        if self.ablation not in (None, *ABLATIONS):
            raise ValueError(
                f"ablation: expected None or one of {ABLATIONS}, got {self.ablation!r}"
            )
        if self.ablation is not None and self.kernel != "exchange":
            raise ValueError(f"ablation: only with kernel='exchange', got kernel={self.kernel!r}")
        if self.gather is not None and self.gather not in GATHERS:
            raise ValueError(f"gather: expected None or one of {GATHERS}, got {self.gather!r}")
        other_async = self.kernel in ("pipelined", "specialized") and self.gather == "async"
        if (
            self.gather not in (None, "registers")
            and not other_async
            and (self.kernel != "exchange" or self.prefetch or self.ablation is not None)
        ):
            raise ValueError(
                f"gather: {self.gather!r} only with kernel='exchange' (or 'async' with "
                f"kernel='pipelined' or 'specialized'), prefetch=False and no ablation, got "
                f"kernel={self.kernel!r}, prefetch={self.prefetch}, ablation={self.ablation!r}"
            )
        if self.q_overlap and self.kernel != "exchange":
            raise ValueError(f"q_overlap: only with kernel='exchange', got kernel={self.kernel!r}")
        if self.kernel not in KERNELS:
            raise ValueError(f"kernel: expected one of {KERNELS}, got {self.kernel!r}")
        if self.prefetch and self.kernel != "exchange":
            raise ValueError(f"prefetch: only with kernel='exchange', got kernel={self.kernel!r}")
        if self.dequant not in ("ptx", "jnp"):
            raise ValueError(f"dequant: expected 'ptx' or 'jnp', got {self.dequant!r}")
        if self.splits is not None and self.splits < 1:
            raise ValueError(f"splits: expected None or >= 1, got {self.splits}")
        if self.merge_columns is not None and (
            self.merge_columns < MERGE_TILE or self.merge_columns % MERGE_TILE
        ):
            raise ValueError(
                f"merge_columns: expected None or a positive multiple of {MERGE_TILE}, got "
                f"{self.merge_columns!r}"
            )

    def merges_in_kernel(self, splits: int) -> bool:
        """Whether a call with `splits` CTAs per (query, head group) merges their partial
        outputs in the kernel (`merge`): the pipelined kernel does when told 'kernel', and by
        default at two splits, where it was the faster (batch 64 on an H100, a cluster of two);
        a cluster of four was 16 µs slower than the merge in XLA (batch 32, H100, 2026-12-06),
        and three splits were not timed. The specialized kernel merges when told 'kernel'. One
        split has nothing to merge."""
        if splits < 2 or self.kernel not in ("pipelined", "specialized") or self.merge == "xla":
            return False
        return self.merge == "kernel" or (self.kernel == "pipelined" and splits == 2)

    def builds_slots(self) -> bool:
        """Whether the kernel builds its key slots itself (`slots`): the pipelined kernel does
        unless told 'xla', the specialized kernel when told 'kernel'; the others read the
        slots an XLA op made."""
        if self.kernel == "specialized":
            return self.slots == "kernel"
        return self.kernel == "pipelined" and self.slots != "xla"

    def gather_for(self, splits: int, staging_fits: bool = True) -> str:
        """The gather a call with `splits` CTAs per (query, head group) runs: `gather` as set;
        else for the pipelined kernel 'async' at one or two splits where its staging fits
        beside the call's slots (`staging_fits`, `resolve_pipelined`), 'registers' at three or
        more (2 to 3 chunks per CTA: 0.6 to 1.1 µs faster at batches 32 and 40 on an H100,
        fifteenth session, NOTES.md) or where it does not fit; 'behind_pv' for one split of
        the exchange kernel without prefetch or ablation (faster there on an H100, slower with
        two splits: the docstring above); else 'registers'."""
        if self.gather is not None:
            return self.gather
        if self.kernel == "pipelined":
            return "async" if staging_fits and splits <= 2 else "registers"
        plain = self.kernel == "exchange" and not self.prefetch and self.ablation is None
        return "behind_pv" if plain and splits == 1 else "registers"


# ---------------------------------------------------------------------------------------------
# Inline Mosaic GPU: per-thread gather and decode.


def _i32(value: int) -> ir.Value:
    return arith.constant(ir.IntegerType.get_signless(32), value)


def _i64(value: int) -> ir.Value:
    return arith.constant(ir.IntegerType.get_signless(64), value)


def _thread_in_warpgroup() -> tuple[ir.Value, ir.Value]:
    """(thread index within the warpgroup, warpgroup index), both i32."""
    tid = mgpu_utils.thread_idx()
    return arith.remui(tid, _i32(WARPGROUP)), arith.divui(tid, _i32(WARPGROUP))


def _row_slot(slots: ir.Value, row: ir.Value) -> tuple[ir.Value, ir.Value]:
    """(valid, clamped row) of the chunk's slot `row`: −1 means skip, row 0 is read instead."""
    slot = memref.load(slots, [arith.index_cast(ir.IndexType.get(), row)])
    valid = arith.cmpi(arith.CmpIPredicate.sge, slot, _i32(0))
    return valid, arith.select(valid, slot, _i32(0))


def _global_address(rows: ir.Value, row: ir.Value, row_bytes: int) -> ir.Value:
    """i64 address of byte 0 of `row` in the GMEM memref `rows` [n, row_bytes]."""
    base = llvm.ptrtoint(ir.IntegerType.get_signless(64), mgpu_utils.memref_ptr(rows))
    offset = arith.muli(arith.extui(ir.IntegerType.get_signless(64), row), _i64(row_bytes))
    return arith.addi(base, offset)


def _load_words(address: ir.Value, offset: int, n_words: int, align: int = 16) -> list[ir.Value]:
    """`n_words` consecutive 32-bit words at address + offset (`.nc`: the packed rows are
    read-only for the kernel's lifetime), in vector loads as wide as `align` bytes allows: a
    window row of D = 256 is 264 bytes, so its odd rows are only 8-byte aligned."""
    i32 = ir.IntegerType.get_signless(32)
    width = min(n_words, align // 4)
    words = []
    for first in range(0, n_words, width):
        at = arith.addi(address, _i64(offset + 4 * first))
        if width == 1:
            ptx = "ld.global.nc.u32 $0, [$1];"
            words.append(mgpu_utils.inline_ptx(ptx, at, result_types=i32))
            continue
        regs = ", ".join(f"${i}" for i in range(width))
        ptx = f"ld.global.nc.v{width}.u32 {{{regs}}}, [${width}];"
        words += mgpu_utils.inline_ptx(ptx, at, result_types=[i32] * width)
    return words


def _store_chunk(
    dst_base: ir.Value, row: ir.Value, tile: ir.Value, tiles: int, chunk: int, words
) -> None:
    """16-byte store of 8 bf16 (dims 8·chunk.. of 64-column tile `tile`, row `row`) into a
    [64, n·64] bf16 buffer with (8, 64) tiling and 128-byte swizzle: tiles of 8 rows × 128 B are
    contiguous, and within one the 16-byte chunk index is XORed with the row (mod 8)."""
    r = arith.andi(row, _i32(7))
    tile_index = arith.addi(arith.muli(arith.shrui(row, _i32(3)), _i32(tiles)), tile)
    tile_offset = arith.shli(tile_index, _i32(10))
    within = arith.addi(arith.shli(r, _i32(7)), arith.shli(arith.xori(r, _i32(chunk)), _i32(4)))
    address = arith.addi(dst_base, arith.addi(tile_offset, within))
    mgpu_utils.inline_ptx(
        "st.shared.v4.b32 [$0], {$1, $2, $3, $4};", address, *words, has_side_effects=True
    )


def _smem_address(ref: ir.Value) -> ir.Value:
    return llvm.ptrtoint(ir.IntegerType.get_signless(32), mgpu_utils.memref_ptr(ref))


@dataclasses.dataclass(frozen=True)
class _Geometry:
    """Static sizes of one call: latent dim, bytes per packed row of each format."""

    dim: int
    kv_row_bytes: int
    window_row_bytes: int

    @property
    def half(self) -> int:  # dims per warpgroup
        return self.dim // 2

    @property
    def tiles(self) -> int:  # 64-column tiles per warpgroup half
        return self.half // 64

    @property
    def pieces(self) -> int:  # 64-dim pieces of one chunk per thread: 64·tiles / 128
        return self.half // 128

    @property
    def fp4_words(self) -> int:  # raw words per thread per chunk: 8 nibble words + 1 scale word
        return 9 * self.pieces

    @property
    def staging_shape(self) -> tuple[int, ...]:  # int32 words of the staged gather, per CTA
        # Per warpgroup, 2·pieces 16-byte slots of nibbles per thread (slot-major), then each
        # thread's `pieces` scale words side by side: 72 bytes a thread at D = 512.
        return (2, self.fp4_words * WARPGROUP)

    @classmethod
    def of(cls, dim: int) -> _Geometry:
        """The geometry of a `dim`-wide latent: NVFP4 main-KV rows, FP8 window rows."""
        return cls(
            dim, formats.packed_row_bytes("nvfp4", dim), formats.packed_row_bytes("fp8", dim)
        )


def _thread_piece(tid: ir.Value, piece: int) -> tuple[ir.Value, ir.Value]:
    """(row, tile) of a thread's `piece`: thread t owns row t mod 64 and tiles t//64 + 2·piece,
    so the 8 threads of a store phase hit 8 rows, hence 8 distinct swizzled banks."""
    row = arith.andi(tid, _i32(63))
    tile = arith.addi(arith.shrui(tid, _i32(6)), _i32(2 * piece))
    return row, tile


def _half_index(half: int | None) -> tuple[ir.Value, ir.Value]:
    """(thread index within the warpgroup, the half of D it decodes: `half`, or for None the
    warpgroup's own index)."""
    tid, wg = _thread_in_warpgroup()
    return tid, wg if half is None else _i32(half)


def _fp4_addresses(
    geometry: _Geometry, kv_rows: ir.Value, slots: ir.Value, half: int | None
) -> tuple[ir.Value, ir.Value, list[tuple[ir.Value, ir.Value]]]:
    """(valid, clamped row, per piece the i64 addresses of its 32 nibble bytes and of its scale
    word) of this thread's share of one chunk's `half` of D (`_half_index`)."""
    i64 = ir.IntegerType.get_signless(64)
    tid, wg = _half_index(half)
    g = geometry
    row, _ = _thread_piece(tid, 0)
    valid, safe = _row_slot(slots, row)
    address = _global_address(kv_rows, safe, g.kv_row_bytes)
    pieces = []
    for piece in range(g.pieces):
        _, tile = _thread_piece(tid, piece)
        # Nibbles of dims [wg·D/2 + 64·tile, +64) start at byte wg·D/4 + 32·tile; the four
        # scales at D/2 + wg·D/32 + 4·tile.
        nib = arith.addi(arith.muli(wg, _i32(g.half // 2)), arith.muli(tile, _i32(32)))
        sc = arith.addi(arith.muli(wg, _i32(g.half // 16)), arith.muli(tile, _i32(4)))
        sc = arith.addi(sc, _i32(g.dim // 2))
        pieces.append(
            (arith.addi(address, arith.extui(i64, nib)), arith.addi(address, arith.extui(i64, sc)))
        )
    return valid, safe, pieces


def _fp4_load(
    geometry: _Geometry,
    kv_rows: ir.Value,
    slots: ir.Value,
    half: int | None,
    gather: bool = True,
) -> list[ir.Value]:
    """This thread's raw NVFP4 words of one chunk's `half` of D (`_half_index`): per piece 8
    words of E2M1 nibbles (64 dims) and 1 word of E4M3 scales; all zero for a −1 slot.
    `gather=False` (the 'no_topk_gather' ablation) makes the words from the row number instead
    of loading them: the decode still runs on values the compiler cannot know."""
    valid, safe, pieces = _fp4_addresses(geometry, kv_rows, slots, half)
    zero = _i32(0)
    words = []
    for piece, (nib_address, sc_address) in enumerate(pieces):
        if gather:
            piece_words = _load_words(nib_address, 0, 8)  # rows of 9D/16 bytes: 16-aligned
            piece_words += _load_words(sc_address, 0, 1)
        else:
            piece_words = [
                arith.xori(safe, _i32(0x01234567 * (9 * piece + i + 1) & 0x7FFFFFFF))
                for i in range(9)
            ]
        words += [arith.select(valid, w, zero) for w in piece_words]
    return words


def _staging_address(staging: ir.Value, tid: ir.Value, quad: int) -> ir.Value:
    """Shared address of this thread's 16-byte slot `quad` of nibbles in a warpgroup's
    `staging` (`_Geometry.staging_shape`): slot-major, so a warp's 32 threads touch 512
    consecutive bytes (no bank conflict)."""
    offset = arith.shli(arith.addi(tid, _i32(quad * WARPGROUP)), _i32(4))
    return arith.addi(_smem_address(staging), offset)


def _staged_scales_address(geometry: _Geometry, staging: ir.Value, tid: ir.Value) -> ir.Value:
    """Shared address of this thread's `pieces` scale words in `staging`, after every thread's
    nibble slots: a warp's 32 threads read 4·pieces·32 consecutive bytes."""
    offset = arith.addi(
        _i32(2 * geometry.pieces * WARPGROUP * 16), arith.muli(tid, _i32(4 * geometry.pieces))
    )
    return arith.addi(_smem_address(staging), offset)


def _fp4_stage(
    geometry: _Geometry, kv_rows: ir.Value, slots: ir.Value, staging: ir.Value, half: int | None
) -> None:
    """Starts copying this thread's raw words of one chunk (`_fp4_load`'s, in the same order)
    into its slots of `staging` with `cp.async`, one commit group: per piece two 16-byte copies
    of nibbles to slots 2·piece and 2·piece + 1, its scale word to this thread's scale word
    `piece` (`_staged_scales_address`).
    A −1 slot copies 0 bytes of row 0: the slots fill with zeros, as `_fp4_load`'s words are."""
    tid, _ = _half_index(half)
    valid, _, pieces = _fp4_addresses(geometry, kv_rows, slots, half)
    size16 = arith.select(valid, _i32(16), _i32(0))
    size4 = arith.select(valid, _i32(4), _i32(0))
    scale_slot = _staged_scales_address(geometry, staging, tid)
    for piece, (nib_address, sc_address) in enumerate(pieces):
        for j in range(2):
            dst = _staging_address(staging, tid, 2 * piece + j)
            src = arith.addi(nib_address, _i64(16 * j))
            mgpu_utils.inline_ptx(CP_ASYNC_16_PTX, dst, src, size16, has_side_effects=True)
        dst = arith.addi(scale_slot, _i32(4 * piece))
        mgpu_utils.inline_ptx(CP_ASYNC_4_PTX, dst, sc_address, size4, has_side_effects=True)
    mgpu_utils.inline_ptx(CP_ASYNC_COMMIT_PTX, has_side_effects=True)


def _fp4_unstage(geometry: _Geometry, staging: ir.Value) -> list[ir.Value]:
    """Waits for this thread's copies (`_fp4_stage`) and reads its words back from `staging`,
    in `_fp4_load`'s order. `cp.async.wait_group` makes a thread's own copies visible to it,
    and no thread reads another's slots: no barrier."""
    i32 = ir.IntegerType.get_signless(32)
    tid, _ = _thread_in_warpgroup()
    mgpu_utils.inline_ptx(CP_ASYNC_WAIT_PTX, has_side_effects=True)

    def read(quad):
        address = _staging_address(staging, tid, quad)
        return list(
            mgpu_utils.inline_ptx(
                LD_SHARED_V4_PTX, address, result_types=[i32] * 4, has_side_effects=True
            )
        )

    scale_ptx = (
        "ld.shared.u32 $0, [$1];"
        if geometry.pieces == 1
        else f"ld.shared.v{geometry.pieces}.u32 {{"
        + ", ".join(f"${i}" for i in range(geometry.pieces))
        + f"}}, [${geometry.pieces}];"
    )
    scales = mgpu_utils.inline_ptx(
        scale_ptx,
        _staged_scales_address(geometry, staging, tid),
        result_types=i32 if geometry.pieces == 1 else [i32] * geometry.pieces,
        has_side_effects=True,
    )
    scales = [scales] if geometry.pieces == 1 else list(scales)
    words = []
    for piece in range(geometry.pieces):
        words += read(2 * piece) + read(2 * piece + 1) + [scales[piece]]
    return words


def _cp_async_drain() -> None:
    """Waits for this thread's outstanding `cp.async` copies (the last chunk's, never read:
    none may still write shared memory when the CTA exits)."""
    mgpu_utils.inline_ptx(CP_ASYNC_WAIT_PTX, has_side_effects=True)


def _fp4_decode_store(
    geometry: _Geometry, words: list[ir.Value], dst: ir.Value, decode: bool = True
) -> None:
    """Decodes `_fp4_load`'s words and stores them as bf16 into the swizzled tile `dst`.
    `decode=False` (the 'no_topk_decode' ablation) stores the raw words instead, each nibble
    word with its scale word folded in, so every loaded word is used."""
    i32 = ir.IntegerType.get_signless(32)
    tid, _ = _thread_in_warpgroup()
    dst_base = _smem_address(dst)
    # A wgmma is awaited per warp, but every warp's share of it reads the whole tile: wait for
    # all four warps before overwriting the previous chunk.
    mgpu_utils.warpgroup_barrier()
    for piece in range(geometry.pieces):
        row, tile = _thread_piece(tid, piece)
        nibbles, scales = words[9 * piece : 9 * piece + 8], words[9 * piece + 8]
        if not decode:
            for k, word in enumerate(nibbles):
                out = [arith.xori(word, scales), word, word, word]
                _store_chunk(dst_base, row, tile, geometry.tiles, k, out)
            continue
        pairs = mgpu_utils.inline_ptx(E4M3_SCALES_PTX, scales, result_types=[i32] * 4)
        for k, word in enumerate(nibbles):
            out = mgpu_utils.inline_ptx(E2M1_PTX, word, pairs[k // 2], result_types=[i32] * 4)
            _store_chunk(dst_base, row, tile, geometry.tiles, k, out)


def _fp8_load_decode_store(
    geometry: _Geometry, win_rows: ir.Value, slots: ir.Value, dst: ir.Value, half: int | None
) -> None:
    """Gathers, decodes (E4M3 × UE8M0) and stores this thread's share of a window chunk's
    `half` of D (`_half_index`): per piece 64 E4M3 bytes and the 2 UE8M0 bytes of its two
    32-dim groups; zeros for a −1 slot."""
    i32, i64 = ir.IntegerType.get_signless(32), ir.IntegerType.get_signless(64)
    tid, wg = _half_index(half)
    g = geometry
    row, _ = _thread_piece(tid, 0)
    valid, safe = _row_slot(slots, row)
    address = _global_address(win_rows, safe, g.window_row_bytes)
    zero = _i32(0)
    pieces = []
    for piece in range(g.pieces):  # all loads first: their latencies overlap
        _, tile = _thread_piece(tid, piece)
        data = arith.addi(arith.muli(wg, _i32(g.half)), arith.muli(tile, _i32(64)))
        sc = arith.addi(arith.muli(wg, _i32(g.half // 32)), arith.muli(tile, _i32(2)))
        data_address = arith.addi(address, arith.extui(i64, data))
        raw = _load_words(data_address, 0, 16, align=math.gcd(g.window_row_bytes, 16))
        # The 2 scale bytes sit at an even offset: load the aligned word holding them.
        sc_address = arith.addi(address, arith.extui(i64, arith.andi(sc, _i32(~3))))
        (sc_word,) = _load_words(sc_address, g.dim, 1)
        sc_word = arith.shrui(sc_word, arith.shli(arith.andi(sc, _i32(3)), _i32(3)))
        pieces.append([arith.select(valid, w, zero) for w in [*raw, sc_word]])
    dst_base = _smem_address(dst)
    mgpu_utils.warpgroup_barrier()  # see `_fp4_decode_store`
    for piece, words in enumerate(pieces):
        row, tile = _thread_piece(tid, piece)
        factors = mgpu_utils.inline_ptx(UE8M0_PTX, words[16], result_types=[i32] * 2)
        for k in range(8):  # 16-byte output chunk k: dims 8k..8k+7 = raw words 2k, 2k+1
            out = []
            for word in words[2 * k : 2 * k + 2]:
                out += mgpu_utils.inline_ptx(
                    E4M3_PTX, word, factors[k // 4], result_types=[i32] * 2
                )
            _store_chunk(dst_base, row, tile, g.tiles, k, out)


def _raw_layout(geometry: _Geometry) -> plgpu.SomeLayout:
    n = geometry.fp4_words
    return plgpu.Layout.WG_STRIDED((WARPGROUP * n,), vec_size=n)


def _pack_raw(words: list[ir.Value], geometry: _Geometry) -> mgpu.FragmentedArray:
    i32 = ir.IntegerType.get_signless(32)
    vec = vector.from_elements(ir.VectorType.get((len(words),), i32), words)
    registers = np.empty((1,), dtype=object)
    registers[0] = vec
    return mgpu.FragmentedArray(
        _registers=registers, _layout=_raw_layout(geometry).to_mgpu(), _is_signed=True
    )


def _unpack_raw(raw: mgpu.FragmentedArray) -> list[ir.Value]:
    vec = raw.registers.flat[0]
    n = ir.VectorType(vec.type).shape[0]
    return [vector.extract(vec, dynamic_position=[], static_position=[i]) for i in range(n)]


# ---------------------------------------------------------------------------------------------
# The dequant step, behind one interface for both paths: `load(rows, slots)` returns the raw data
# to carry (the prefetch), `store(raw, dst, rows, slots)` writes the bf16 tile of one half of D
# of a top-k chunk, `window(rows, slots, dst)` does both for a window chunk; the staged gather
# (`TuningConfig.gather='async'`): `stage(rows, slots, staging)` starts the copies of a top-k
# chunk's words, `store_staged(staging, dst, rows, slots)` waits for them and writes the tile,
# `drain()` waits for any copies left. The half: `half`, or for None the calling warpgroup's own.


@dataclasses.dataclass(frozen=True)
class _Dequant:
    load: Callable[..., jax.Array]
    store: Callable[..., None]
    window: Callable[..., None]
    stage: Callable[..., None]
    store_staged: Callable[..., None]
    drain: Callable[[], None]


def _ptx_dequant(
    geometry: _Geometry, half: int | None = None, ablation: str | None = None
) -> _Dequant:
    """The GPU path; `ablation` 'no_topk_gather' or 'no_topk_decode' leaves that step out of
    the top-k chunks (`TuningConfig.ablation`)."""
    raw_type = plgpu.ShapeDtypeStruct(
        (WARPGROUP * geometry.fp4_words,), jnp.int32, layout=_raw_layout(geometry)
    )
    gather, decode = ablation != "no_topk_gather", ablation != "no_topk_decode"

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.RefType()), return_type=raw_type)
    def load(ctx, kv_rows, slots):
        del ctx
        return _pack_raw(_fp4_load(geometry, kv_rows, slots, half, gather), geometry)

    @plgpu.inline_mgpu(arg_types=(_raw_layout(geometry), plgpu.RefType(_TILE)))
    def store_raw(ctx, raw, dst):
        del ctx
        _fp4_decode_store(geometry, _unpack_raw(raw), dst, decode)

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.RefType(), plgpu.RefType(_TILE)))
    def window(ctx, win_rows, slots, dst):
        del ctx
        _fp8_load_decode_store(geometry, win_rows, slots, dst, half)

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.RefType(), plgpu.RefType()))
    def stage(ctx, kv_rows, slots, staging):
        del ctx
        _fp4_stage(geometry, kv_rows, slots, staging, half)

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.RefType(_TILE)))
    def store_staged(ctx, staging, dst):
        del ctx
        _fp4_decode_store(geometry, _fp4_unstage(geometry, staging), dst, decode)

    @plgpu.inline_mgpu()
    def drain(ctx):
        del ctx
        _cp_async_drain()

    return _Dequant(
        load,
        lambda raw, dst, rows, slots: store_raw(raw, dst),
        window,
        stage,
        lambda staging, dst, rows, slots: store_staged(staging, dst),
        drain,
    )


def _jnp_dequant(geometry: _Geometry, half: int | None = None) -> _Dequant:
    """The interpret-mode stand-in: gather whole rows and unpack them with `formats.unpack`;
    the staged gather's copies are the gather itself (`stage` and `drain` do nothing).

    A top-k chunk's `load` gathers its words as the GPU path does (as many, all zero for a −1
    slot, in another order) and `store` decodes the words it is given, not the rows: so the
    interpreter checks which chunk's words each step of a variant carries (`prefetch`,
    `gather='behind_pv'`). The words of one half of D are the rows' nibbles of those dims, then
    their scale bytes: an NVFP4 row of D/2 values (`formats.pack`'s layout)."""
    g = geometry

    def part():
        return lax.axis_index("wg") if half is None else half

    def decode(rows_ref, slots_ref, dst_ref, fmt):
        slots = slots_ref[...]
        rows = jnp.take(rows_ref[...], jnp.maximum(slots, 0), axis=0)
        values = jnp.where(slots[:, None] >= 0, formats.unpack(rows, fmt, g.dim), 0.0)
        values = lax.dynamic_slice_in_dim(values, part() * g.half, g.half, axis=1)
        dst_ref[...] = values.astype(jnp.bfloat16)

    def load(rows_ref, slots_ref):
        slots = slots_ref[...]
        rows = jnp.take(rows_ref[...], jnp.maximum(slots, 0), axis=0)
        rows = jnp.where(slots[:, None] >= 0, rows, 0)
        nibbles = lax.dynamic_slice_in_dim(rows, part() * g.half // 2, g.half // 2, axis=1)
        scales = lax.dynamic_slice_in_dim(rows, g.dim // 2 + part() * g.half // 16, g.half // 16, 1)
        half_rows = jnp.concatenate([nibbles, scales], axis=1)
        words = lax.bitcast_convert_type(half_rows.reshape(BLOCK_KV, -1, 4), jnp.int32)
        return words.reshape(WARPGROUP * g.fp4_words)

    def store(raw, dst_ref):
        half_rows = lax.bitcast_convert_type(raw.reshape(BLOCK_KV, -1), jnp.uint8)
        values = formats.unpack(half_rows.reshape(BLOCK_KV, -1), "nvfp4", g.half)
        dst_ref[...] = values.astype(jnp.bfloat16)

    return _Dequant(
        load=load,
        store=lambda raw, dst, rows, slots: store(raw, dst),
        window=lambda rows, slots, dst: decode(rows, slots, dst, "fp8"),
        stage=lambda rows, slots, staging: None,
        store_staged=lambda staging, dst, rows, slots: decode(rows, slots, dst, "nvfp4"),
        drain=lambda: None,
    )


# ---------------------------------------------------------------------------------------------
# The kernels: the warp-specialized one and the first one, with the logit exchange (the default).
# Both share the online softmax step and the output's epilogue.


def _split_range(split, splits: int, n_window_chunks: int, n_topk_chunks: int):
    """This split's chunks [lo, hi) of the window-then-top-k list (never empty: splits <= the
    number of chunks)."""
    n_chunks = n_window_chunks + n_topk_chunks
    return split * n_chunks // splits, (split + 1) * n_chunks // splits


def _open_softmax(sink_smem, half: int, split):
    """(acc, m, denom) before the first key: the sink opens the running max and sum, so an
    empty row gives acc = 0 and l = 1 (or l = 0 for a −inf sink, guarded at the end), never
    NaN. Only split 0 has the sink (the others add −inf to it, so l starts at 0; a NaN sink
    stays NaN in split 0, hence in the merge). `sink_smem`: the sink logits as given, taken
    here to the log2 domain."""
    sink = plgpu.load(sink_smem, layout=plgpu.Layout.WGMMA.reduce(1))
    sink = sink * _LOG2E + jnp.where(split == 0, 0.0, -jnp.inf)
    m0 = jnp.maximum(sink, -1e30)
    acc0 = plgpu.layout_cast(jnp.zeros((BLOCK_HEADS, half), jnp.float32), plgpu.Layout.WGMMA)
    return acc0, m0, jnp.exp2(sink - m0)


def _softmax_step(s, slots_ref, acc, m, denom, logit_scale: float, peer_max=None):
    """One chunk of the online softmax (log2 domain) on the logits `s` [64 heads, keys] of the
    keys whose slots `slots_ref` holds: returns (p as bf16, acc rescaled to the new max, the new
    max, the new sum). `peer_max` (qk='keys'): the other warpgroup's new row maxima, given
    this one's, so that both rescale to the same max of all the chunk's keys."""
    slots = plgpu.load(slots_ref, layout=plgpu.Layout.WGMMA.reduce(0))
    valid = lax.broadcast_in_dim(slots >= 0, s.shape, [1])
    s = jnp.where(valid, s * logit_scale, -jnp.inf)
    m_new = jnp.maximum(m, s.max(axis=1))
    if peer_max is not None:
        m_new = jnp.maximum(m_new, peer_max(m_new))
    alpha = jnp.exp2(m - m_new)
    p = jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
    denom = denom * alpha + p.sum(axis=1)
    acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
    return p.astype(jnp.bfloat16), acc, m_new, denom


HALF_KV = BLOCK_KV // 2  # keys per warpgroup with qk='keys'


@plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA, plgpu.RefType(_TILE)))
def _store_p_half(ctx, p, dst):
    """Stores this warpgroup's P [64 heads, 32 keys] (bf16, WGMMA layout) into columns
    [32·wg, 32·wg + 32) of the [64, 64] tile `dst` ((8, 64) tiling, 128-byte swizzle), one
    32-bit pair per register: the tile's 16-byte chunk of a column is XORed with the row
    (mod 8), as `_store_chunk`. Pallas refuses a column slice inside a 64-wide tile, so the
    addresses are computed here."""
    del ctx
    i32 = ir.IntegerType.get_signless(32)
    _, wg = _thread_in_warpgroup()
    base = _smem_address(dst)
    column0 = arith.muli(wg, _i32(HALF_KV))
    registers = np.ndindex(p.registers.shape)
    for idx, reg_idx in zip(p.layout.thread_idxs(p.shape), registers, strict=True):
        row, col = (arith.index_cast(i32, i) for i in idx)
        col = arith.addi(col, column0)
        r = arith.andi(row, _i32(7))
        chunk = arith.xori(arith.shrui(col, _i32(3)), r)
        address = arith.addi(base, arith.shli(arith.shrui(row, _i32(3)), _i32(10)))
        address = arith.addi(address, arith.shli(r, _i32(7)))
        address = arith.addi(address, arith.shli(chunk, _i32(4)))
        address = arith.addi(address, arith.shli(arith.andi(col, _i32(7)), _i32(1)))
        word = mgpu_utils.bitcast(p.registers[reg_idx], i32)
        mgpu_utils.inline_ptx("st.shared.b32 [$0], $1;", address, word, has_side_effects=True)


@dataclasses.dataclass(frozen=True)
class _SplitKeys:
    """The shared memory of qk='keys' (two warpgroups, 32 keys each): `p_tile` [64, 64] bf16,
    `barriers` [2] (the row maxima, then P: both warpgroups arrive) and `rows` [2, 64] f32
    (the row exchange, `_exchange_rows`)."""

    p_tile: object
    barriers: object
    rows: object

    @staticmethod
    def scratch(interpret: bool, rows: bool = True) -> list:
        """The scratch a kernel allocates for these, in this order: the P tile (plain where
        interpreted), the two barriers, and the rows unless the kernel lends its own."""
        tile = plgpu.SMEM(
            (BLOCK_HEADS, BLOCK_KV), jnp.bfloat16, transforms=() if interpret else _TILE
        )
        shared = [tile, plgpu.Barrier(num_arrivals=2, num_barriers=2)]  # the maxima, P
        return [*shared, plgpu.SMEM((2, BLOCK_HEADS), jnp.float32)] if rows else shared

    @classmethod
    def take(cls, optional: list, merge_stage=None) -> _SplitKeys:
        """What `scratch` allocated, popped from the front of a kernel's `optional` scratch: the
        P tile and its barriers, then the rows, or with `merge_stage` (the merge's
        log-sum-exp stage [splits, 64], `_merge_scratch`) its first two rows. That stage is
        written (by a bulk copy) only after the cluster barrier, which both warpgroups pass
        after their last exchange: 512 bytes saved, what batch 64 lacked for the pipelined
        kernel's staging and put the specialized kernel 128 bytes over."""
        p_tile, barriers = optional.pop(0), optional.pop(0)
        rows = optional.pop(0) if merge_stage is None else merge_stage.at[pl.ds(0, 2)]
        return cls(p_tile, barriers, rows)

    @staticmethod
    def sink_share(denom, wg):
        """`_open_softmax`'s row sums as warpgroup `wg`'s share, so that the two shares add up
        to the row sums (`sum_rows`): the sink's term counted once, in warpgroup 0's share, and
        warpgroup 1's zero (a NaN sink is NaN in both, so it reaches the output as it does the
        definition's)."""
        return denom * jnp.where(wg == 0, 1.0, 0.0)

    def softmax(self, s, slots_ref, acc, m, denom, logit_scale: float, interpret: bool):
        """`_softmax_step` for qk='keys': `s` [64 heads, 32 keys] holds this warpgroup's keys
        [32·wg, 32·wg + 32) only. The two warpgroups swap their new row maxima (max is exact
        and commutes: both get the same m), each writes its half of P into `p_tile` and fences
        it for the wgmmas, and both meet at the P barrier: on return both halves are there
        for PV. `denom` is this warpgroup's own share of the row sums (its keys; the sink in
        warpgroup 0's), summed across the two at the end (`sum_rows`)."""
        wg = lax.axis_index("wg")
        p16, acc, m_new, denom = _softmax_step(
            s,
            slots_ref.at[pl.ds(wg * HALF_KV, HALF_KV)],
            acc,
            m,
            denom,
            logit_scale,
            peer_max=lambda m_own: _exchange_rows(m_own, self.rows, self.barriers.at[0]),
        )
        if interpret:  # a plain buffer there: the interpreter slices it
            for w in range(2):

                @pl.when(wg == w)
                def _(w=w):
                    self.p_tile.at[:, pl.ds(w * HALF_KV, HALF_KV)][...] = p16

        else:
            _store_p_half(p16, self.p_tile)
        plgpu.commit_smem()  # ordinary stores, read by the wgmmas (the async proxy)
        plgpu.barrier_arrive(self.barriers.at[1])  # both halves of P written
        plgpu.barrier_wait(self.barriers.at[1])
        return acc, m_new, denom

    def sum_rows(self, denom):
        """Both warpgroups' shares of the row sums (a + b == b + a: the same sums in both)."""
        return denom + _exchange_rows(denom, self.rows, self.barriers.at[0])


def _exchange_rows(x, mx_smem, mx_barrier):
    """The other warpgroup's per-row vector `x` [64] (WGMMA rows): each writes its own to
    `mx_smem[wg]`, both meet at `mx_barrier`, each reads the other's. A warpgroup writes its
    slot again only after the next barrier of the chunk (the P tile's), which the other passes
    only after reading it."""
    wg = lax.axis_index("wg")
    mx_smem[wg] = x
    plgpu.barrier_arrive(mx_barrier)
    plgpu.barrier_wait(mx_barrier)
    return plgpu.load(mx_smem.at[1 - wg], layout=plgpu.Layout.WGMMA.reduce(1))


def _pv_in_interpreter(acc, p16, p_smem, v_ref):
    """acc + P·V as the interpreter can run it: it runs neither `run_state` nor a wgmma with A
    in registers, so P is staged in shared memory and a fresh product is added."""
    p_smem[...] = p16
    plgpu.commit_smem()
    return acc + _pv_fresh(p_smem, v_ref, acc.shape)


def _pv_fresh(p_smem, v_ref, shape):
    """P·V from shared memory into a fresh accumulator of `shape` (the interpreter's PV)."""

    def pv(acc_ref):
        plgpu.wgmma(acc_ref, p_smem, v_ref)
        return acc_ref[...]

    return pl.run_scoped(pv, plgpu.ACC(shape, jnp.float32))


def _write_output(acc, m, denom, out_smem, o_ref, lse_ref, lse_smem, *, b, split, heads, splits):
    """acc / l as bf16 through `out_smem` (a [64, D/2] buffer no wgmma reads any more) to this
    warpgroup's half of o_ref[b, split, heads]; with splits, warpgroup 0 also writes the
    log2-sum-exp the combine weighs the splits by (both warpgroups hold it)."""
    wg = lax.axis_index("wg")
    half = out_smem.shape[-1]
    out = acc / lax.broadcast_in_dim(jnp.where(denom > 0, denom, 1.0), acc.shape, [0])
    out_smem[...] = out.astype(jnp.bfloat16)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(
        out_smem, o_ref.at[b, split, heads, pl.ds(wg * half, half)], commit_group=False
    )
    if splits > 1:

        @pl.when(wg == 0)
        def _():
            lse_smem[...] = m + jnp.log2(denom)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[b, split, heads], commit_group=False)

    plgpu.commit_smem_to_gmem_group()
    plgpu.wait_smem_to_gmem(0)


@plgpu.inline_mgpu()
def _publish_partials(ctx):
    """Before the cluster barrier of `_merge_splits`: the partial's bulk copies to global memory
    (async proxy, completed) ordered before the arrival, at cluster scope."""
    del ctx
    mgpu_utils.inline_ptx("fence.proxy.async.global;", has_side_effects=True)
    mgpu_utils.inline_ptx("fence.acq_rel.cluster;", has_side_effects=True)


@plgpu.inline_mgpu()
def _acquire_partials(ctx):
    """After the cluster barrier: the other splits' partials, read next by bulk copies (async
    proxy), ordered after the wait."""
    del ctx
    mgpu_utils.inline_ptx("fence.acq_rel.cluster;", has_side_effects=True)
    mgpu_utils.inline_ptx("fence.proxy.async.global;", has_side_effects=True)


def _merge_splits(
    o_ref,
    lse_ref,
    final_ref,
    k_smem,
    q_smem,
    lse_stage,
    half_barrier,
    lse_barrier,
    cluster_barrier,
    *,
    b,
    split,
    heads,
    splits: int,
    half: int,
    pass_columns: int | None,
):
    """The split-KV merge inside the kernel (`TuningConfig.merge='kernel'`), after every CTA of
    the cluster (the `splits` of one query and head group) wrote its partial output and
    log2-sum-exp (`_write_output`, awaited). The cluster meets at `cluster_barrier`; then half
    h of the output's D is merged by warpgroup h of split h (the others are done): that half
    of every split's partial is copied back (L2 holds them; a bulk copy fills whole swizzled
    [64, D/2] buffers only), weighted by exp2(lse − max lse) / Σ, summed in float32 and
    written to `final_ref` as bf16 (`pass_columns` of them a pass of a loop; None: all at
    once, unrolled: `TuningConfig.merge_columns`). An empty row (every lse −inf) gives
    zeros, a NaN lse NaN: as `_combine_splits`. The partials go through [64, D/2] buffers of
    shared memory that no one reads once the cluster has met: this warpgroup's halves of the
    two key tiles `k_smem` [2, 2, 64, D/2], its half of q (`q_smem` [2, 64, D/2]), then one
    of the other warpgroup's, which does not merge. GPU only (`fp4_sparse_attention_mgpu`
    merges in XLA when interpreted)."""
    wg = lax.axis_index("wg")
    views = [k_smem.at[0, wg], k_smem.at[1, wg], q_smem.at[wg], k_smem.at[0, 1 - wg]][:splits]
    _publish_partials()
    plgpu.barrier_arrive(cluster_barrier)
    plgpu.barrier_wait(cluster_barrier)

    @pl.when(wg == split)  # split < 2: warpgroup `split` merges half `split`
    def _():
        _acquire_partials()
        plgpu.copy_gmem_to_smem(lse_ref.at[b, :, heads], lse_stage, lse_barrier)
        columns = pl.ds(wg * half, half)
        for p in range(splits):
            plgpu.copy_gmem_to_smem(o_ref.at[b, p, heads, columns], views[p], half_barrier)
        plgpu.barrier_wait(lse_barrier)
        lses = [
            plgpu.load(lse_stage.at[p], layout=plgpu.Layout.WGMMA.reduce(1)) for p in range(splits)
        ]
        top = functools.reduce(jnp.maximum, lses)
        top = jnp.where(top > -jnp.inf, top, 0.0)
        weights = [jnp.exp2(lse - top) for lse in lses]
        total = functools.reduce(jnp.add, weights)
        total = jnp.where(total > 0, total, 1.0)
        plgpu.barrier_wait(half_barrier)

        def merge_pass(at):  # at: a slice of the columns, None for all
            out = None
            for p in range(splits):
                part = plgpu.load(
                    views[p] if at is None else views[p].at[:, at], layout=plgpu.Layout.WGMMA
                )
                part = part.astype(jnp.float32)
                part = part * lax.broadcast_in_dim(weights[p] / total, part.shape, [0])
                out = part if out is None else out + part
            # Each thread stores the elements it loaded: views[0] is read back only by itself.
            (views[0] if at is None else views[0].at[:, at])[...] = out.astype(jnp.bfloat16)

        if pass_columns is None or pass_columns == half:
            merge_pass(None)
        else:
            n = pass_columns  # `fp4_sparse_attention_mgpu` checked that it divides half
            assert half % n == 0, (half, n)

            def loop_pass(t, carry):
                merge_pass(pl.ds(pl.multiple_of(t * n, n), n))
                return carry

            lax.fori_loop(0, half // n, loop_pass, None)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(views[0], final_ref.at[b, heads, columns])
        plgpu.wait_smem_to_gmem(0)


def _merge_scratch(splits: int) -> list:
    """`_merge_splits`' shared memory, in its order: the splits' log2-sum-exps [splits, 64],
    the barrier of the partials' halves, that of the log-sum-exps, and the cluster's barrier,
    at which the two warpgroups that write the output of each CTA arrive."""
    return [
        plgpu.SMEM((splits, BLOCK_HEADS), jnp.float32),
        plgpu.Barrier(num_arrivals=splits),  # a half of each split's partial
        plgpu.Barrier(),  # the log-sum-exps
        plgpu.ClusterBarrier(collective_axes=("split",), num_arrivals=2),
    ]


PV_COLUMNS = 128
"""The columns of one PV wgmma in the four-warpgroup kernel (`producers=2`): its D/2 = 256
output columns at D = 512 as two wgmmas of 64 float32 accumulator registers a thread each.
Four warpgroups start at 65,536 / 512 = 128 registers a thread, and ptxas wants every
instruction to fit that count whatever `setmaxnreg` raises it to later: one n = 256 wgmma
holds 128 accumulator registers and was refused, "register target of 154" (an H100,
2026-12-07); the two of 128 assemble (`pallas_kernels.registers` on that PTX with each split
by hand; NOTES.md)."""


def _pv(acc_ref, p, v_ref, columns: int, width: int) -> None:
    """acc_ref [64, width] += p [64, keys] · v_ref [keys, width], as `width / columns` wgmmas
    of `columns` output columns each (one, unsliced, where `columns` >= `width`)."""
    if columns >= width:
        plgpu.wgmma(acc_ref, p, v_ref)
        return
    for i in range(width // columns):
        part = pl.ds(i * columns, columns)
        plgpu.wgmma(acc_ref.at[:, part], p, v_ref.at[:, part])


SPECIALIZED_REGISTERS = {1: (224, 56), 2: (184, 72)}
"""Per-thread registers (consumers, producers) of the warp-specialized kernel's roles
(`setmaxnreg`) by its number of producer warpgroups: 2 · 224 + 56 = 504, all that three
warpgroups start with (`entry_registers(3)` = 168 each); 2 · 184 + 2 · 72 = 512, all of four
warpgroups' 128 each."""


def _specialized_kernel(
    q_ref,
    kv_ref,
    win_ref,
    slots_ref,
    sink_ref,
    o_ref,
    lse_ref,
    *refs,
    geometry: _Geometry,
    n_window_chunks: int,
    n_topk_chunks: int,
    splits: int,
    logit_scale: float,
    dequant: tuple[_Dequant, _Dequant],
    gather: str,
    interpret: bool,
    split_keys: bool = False,
    producers: int = 1,
    registers: tuple[int, int] = SPECIALIZED_REGISTERS[1],
    merge: bool = False,
    merge_columns: int | None = None,
):
    """The warp-specialized kernel (`TuningConfig(kernel='specialized')`, slower than the
    default on the H200: `NOTES.md`): warpgroups 0 and 1 compute, warpgroup 2 gathers and
    decodes. k_smem holds two key tiles [2 slots, 2 halves of D, 64 keys, D/2];
    chunk c lives in slot c % 2. `optional`: the staged gather's words
    (`_Geometry.staging_shape`, one row per half of D) with gather='async'; `_merge_splits`'
    scratch with `merge`; the P tile, its two barriers and the row exchange with
    `split_keys`; then P's buffer where interpreted. With `merge` (`TuningConfig.merge`),
    `refs` starts with the merged output [B, H, D], the splits of a query and head group are
    one cluster, and the two consumers merge as `_pipelined_kernel`'s two warpgroups do.

    - The producer (warpgroup 2; `SPECIALIZED_REGISTERS`): per chunk, waits until both
      consumers released the slot (`empty_barriers`), gathers and decodes both halves of D
      into it and arrives on `full_barriers`: the decode of chunk c + 1 runs while the
      consumers compute chunk c. With `producers=2`, warpgroups 2 and 3 each do so for one
      half of D, and a tile is full once both arrived. With gather='registers' a producer
      loads a top-k chunk's words when it starts that chunk and waits for them; with 'async'
      it copies the words of top-k chunk c + 1 into the staging (`cp.async`) right after
      decoding chunk c, so their trip from HBM overlaps its wait for the next free slot (the
      first top-k chunk's copies start before the window's chunks).
    - Each consumer (warpgroup w < 2): waits for the tile, S = Q·K^T over the
      full D (two wgmma 64×64×D/2; both consumers compute the same logits, twice the QK^T work
      of splitting D, but no exchange of partial logits, whose shared memory now holds the
      second tile), the online softmax, PV into its half of the output, releases the slot.
      With `split_keys` (qk='keys'), consumer w computes the logits of keys [32w, 32w + 32)
      only, and the two share the chunk's softmax as `_pipelined_kernel`'s split keys do
      (`_SplitKeys.softmax`: the row maxima swapped, P written into one shared tile that
      both PVs read): QK^T's tensor work is no longer done twice.
    """
    final_ref, *refs = refs if merge else (None, *refs)
    q_smem, k_smem, slots_smem, sink_smem, lse_smem, *refs = refs
    load_barriers, full_barriers, empty_barriers, done_barrier, *optional = refs
    b, g, split = lax.axis_index("b"), lax.axis_index("g"), lax.axis_index("split")
    wg = lax.axis_index("wg")
    half = geometry.half
    heads = pl.ds(g * BLOCK_HEADS, BLOCK_HEADS)
    lo, hi = _split_range(split, splits, n_window_chunks, n_topk_chunks)
    consumer_registers, producer_registers = registers
    pv_columns = PV_COLUMNS if producers == 2 else half  # four warpgroups: `PV_COLUMNS`
    staged = gather == "async"
    optional = list(optional)
    staging = optional.pop(0) if staged else None
    merge_scratch = [optional.pop(0) for _ in range(4)] if merge else None
    if split_keys:  # the P tile, its barriers (maxima, P), the row exchange
        shared = _SplitKeys.take(optional, merge_scratch[0] if merge else None)
    p_smem = optional.pop(0) if interpret else None
    assert not optional, optional
    # One copy of the slots, read by every warpgroup (a copy each took 5 KB more at top-512:
    # what the staged words beside the split keys' P tile lacked): brought by consumer 0, or
    # built by every thread of the CTA (`_RawSlots`), before the warpgroups part into roles.
    slots_bar = load_barriers.at[1]
    raw_slots = isinstance(slots_ref, _RawSlots)
    if raw_slots:
        slots_ref.build(slots_ref.valid.at[b], slots_ref.indices.at[b], slots_smem)
    else:

        @pl.when(wg == 0)
        def _():
            plgpu.copy_gmem_to_smem(slots_ref.at[b], slots_smem, slots_bar)

    def await_slots():
        if not raw_slots:  # built ones are there: the build ends in the CTA's barrier
            plgpu.barrier_wait(slots_bar)

    def chunk_slots(chunk):
        return slots_smem.at[chunk]

    def producer(halves: tuple[int, ...]):
        """Gathers and decodes `halves` of D of every chunk (both for one producer, its own
        for each of two)."""
        plgpu.set_max_registers(producer_registers, action="decrease")
        kv_rows, win_rows = kv_ref.at[b], win_ref.at[b]
        await_slots()
        mine = [(h, dequant[h]) for h in halves]

        def stage(c):  # start the copies of top-k chunk c's words, this producer's halves
            for h, dq in mine:
                dq.stage(kv_rows, chunk_slots(c), staging.at[h])

        if staged:
            first_topk = jnp.maximum(lo, n_window_chunks)

            @pl.when(first_topk < hi)
            def _():
                stage(first_topk)

        def produce(c, _):
            slot = c % 2

            @pl.when(c >= lo + 2)
            def _():  # chunk c − 2 in this slot is consumed
                plgpu.barrier_wait(empty_barriers.at[slot])

            @pl.when(c < n_window_chunks)
            def _():
                for h, dq in mine:
                    dq.window(win_rows, chunk_slots(c), k_smem.at[slot, h])

            @pl.when(c >= n_window_chunks)
            def _():
                if staged:
                    for h, dq in mine:
                        dq.store_staged(staging.at[h], k_smem.at[slot, h], kv_rows, chunk_slots(c))

                    @pl.when(c + 1 < hi)
                    def _():  # each thread rereads only its own slots: no barrier first
                        stage(c + 1)

                    return
                # All halves' loads first: their latencies overlap.
                raws = [dq.load(kv_rows, chunk_slots(c)) for _, dq in mine]
                for (h, dq), raw in zip(mine, raws, strict=True):
                    dq.store(raw, k_smem.at[slot, h], kv_rows, chunk_slots(c))

            plgpu.commit_smem()  # the wgmma reads what ordinary stores wrote
            plgpu.barrier_arrive(full_barriers.at[slot])
            return _

        lax.fori_loop(lo, hi, produce, None)

    for p in range(producers):  # warpgroup 2 + p; one producer decodes both halves
        pl.when(wg == 2 + p)(functools.partial(producer, (0, 1) if producers == 1 else (p,)))

    @pl.when(wg < 2)
    def _consumer():
        plgpu.set_max_registers(consumer_registers, action="increase")
        q_bar, sink_bar = load_barriers.at[3 * wg], load_barriers.at[3 * wg + 2]
        plgpu.copy_gmem_to_smem(q_ref.at[b, heads, pl.ds(wg * half, half)], q_smem.at[wg], q_bar)
        plgpu.copy_gmem_to_smem(sink_ref.at[heads], sink_smem.at[wg], sink_bar)
        await_slots()
        plgpu.barrier_wait(sink_bar)
        acc, m, denom = _open_softmax(sink_smem.at[wg], half, split)
        if split_keys:
            denom = _SplitKeys.sink_share(denom, wg)
        for other in range(2):  # QK^T reads both halves of q
            plgpu.barrier_wait(load_barriers.at[3 * other])
        keys = pl.ds(pl.multiple_of(wg * HALF_KV, HALF_KV), HALF_KV) if split_keys else slice(None)
        n_keys = HALF_KV if split_keys else BLOCK_KV

        def step(c, carry):
            acc, m, denom = carry
            slot = c % 2
            plgpu.barrier_wait(full_barriers.at[slot])
            tile = k_smem.at[slot]

            def qk(s_ref):
                for h in range(2):
                    plgpu.wgmma(s_ref, q_smem.at[h], tile.at[h, keys].T)
                return s_ref[...]

            s = pl.run_scoped(qk, plgpu.ACC((BLOCK_HEADS, n_keys), jnp.float32))
            if split_keys:
                acc, m, denom = shared.softmax(
                    s, chunk_slots(c), acc, m, denom, logit_scale, interpret
                )
                if interpret:
                    acc = acc + _pv_fresh(shared.p_tile, tile.at[wg], acc.shape)
                else:

                    def pv_shared(acc_ref):  # P from the shared tile
                        _pv(acc_ref, shared.p_tile, tile.at[wg], pv_columns, half)

                    acc = pl.run_state(pv_shared)(plgpu.ACC.init(acc))
                plgpu.barrier_arrive(empty_barriers.at[slot])
                return acc, m, denom
            p16, acc, m, denom = _softmax_step(s, chunk_slots(c), acc, m, denom, logit_scale)
            if interpret:
                acc = _pv_in_interpreter(acc, p16, p_smem.at[wg], tile.at[wg])
            else:

                def pv(acc_ref):  # accumulates onto acc in place; run_state awaits it on exit
                    _pv(acc_ref, p16, tile.at[wg], pv_columns, half)

                acc = pl.run_state(pv)(plgpu.ACC.init(acc))
            plgpu.barrier_arrive(empty_barriers.at[slot])
            return acc, m, denom

        acc, m, denom = lax.fori_loop(lo, hi, step, (acc, m, denom))
        if split_keys:  # both consumers' shares of the row sums
            denom = shared.sum_rows(denom)
            if merge:  # the exchange's stores, before a bulk copy rewrites them (`lse_stage`)
                plgpu.commit_smem()
        # Once both consumers are done, no wgmma reads q: its buffer takes the output.
        plgpu.barrier_arrive(done_barrier)
        plgpu.barrier_wait(done_barrier)
        _write_output(
            acc,
            m,
            denom,
            q_smem.at[wg],
            o_ref,
            lse_ref,
            lse_smem,
            b=b,
            split=split,
            heads=heads,
            splits=splits,
        )
        if merge:
            _merge_splits(
                o_ref,
                lse_ref,
                final_ref,
                k_smem,
                q_smem,
                *merge_scratch,
                b=b,
                split=split,
                heads=heads,
                splits=splits,
                half=half,
                pass_columns=merge_columns,
            )


@dataclasses.dataclass(frozen=True)
class _RawSlots:
    """The call's window validity [B, W] and top-k indices [B, K] as given, for a kernel that
    builds its slots itself (`_slot_builder`) instead of reading them from an XLA op."""

    valid: object
    indices: object
    build: Callable[..., None]


def _byte_row_address(row: ir.Value) -> ir.Value:
    """i64 address of element 0 of `row`, a bool GMEM memref (a row of a [B, W] array) that XLA
    stores one byte per element. `mgpu_utils.memref_ptr` counts a sub-byte element type's
    offset in bits (bool is i1: the offset of row b came out as b·W/8 bytes, and the first GPU
    run of `_slot_builder` read other rows' flags for every query but the first), so the
    descriptor's offset is taken here as bytes."""
    i64 = ir.IntegerType.get_signless(64)
    memref_ty = ir.MemRefType(row.type)
    ptr_ty = llvm.PointerType.get(mgpu_utils.get_memref_llvm_address_space(memref_ty))
    fields = [ptr_ty, ptr_ty, i64]
    if memref_ty.shape:
        fields += [llvm.ArrayType.get(i64, len(memref_ty.shape))] * 2
    desc = builtin.unrealized_conversion_cast([llvm.StructType.get_literal(fields)], [row])
    aligned = llvm.ptrtoint(i64, llvm.extractvalue(ptr_ty, desc, [1]))
    return arith.addi(aligned, llvm.extractvalue(i64, desc, [2]))


def _slot_builder(
    *,
    n_window: int,
    n_topk: int,
    n_kv: int,
    n_window_chunks: int,
    n_chunks: int,
    warpgroups: int = 2,
):
    """The slots of one query, built in the kernel from the call's raw arrays (GPU only): every
    thread of the CTA (`warpgroups`) loads a few window flags (bytes) and top-k indices and
    stores their slots, as `fp4_sparse_attention_mgpu` makes them in XLA: window row w where it
    is valid, top-k index i where 0 <= i < n_kv, −1 elsewhere and in the padding of the last
    chunk of each part; then a barrier of the whole CTA (`bar.sync 0`, all its threads), after
    which every warpgroup reads them. Saves the XLA op that built them (1.6 to 1.8 µs)."""
    threads, total = warpgroups * WARPGROUP, n_chunks * BLOCK_KV
    window_end = n_window_chunks * BLOCK_KV

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.RefType(), plgpu.RefType()))
    def build(ctx, valid_row, index_row, slots):
        del ctx
        i32, i64 = ir.IntegerType.get_signless(32), ir.IntegerType.get_signless(64)
        tid = mgpu_utils.thread_idx()
        valid_base = _byte_row_address(valid_row)
        index_base = llvm.ptrtoint(i64, mgpu_utils.memref_ptr(index_row))
        dst = _smem_address(slots)
        minus_one = _i32(-1)

        def less(a, bound):
            return arith.cmpi(arith.CmpIPredicate.slt, a, _i32(bound))

        for k in range(-(-total // threads)):
            e = arith.addi(tid, _i32(k * threads))
            slot = minus_one
            if n_topk:  # top-k entry t = e − window_end: index i where 0 <= i < n_kv
                t = arith.subi(e, _i32(window_end))
                safe = arith.maxsi(arith.minsi(t, _i32(n_topk - 1)), _i32(0))
                at = arith.addi(index_base, arith.shli(arith.extui(i64, safe), _i64(2)))
                index = mgpu_utils.inline_ptx("ld.global.nc.u32 $0, [$1];", at, result_types=i32)
                ok = arith.andi(arith.cmpi(arith.CmpIPredicate.sge, t, _i32(0)), less(t, n_topk))
                ok = arith.andi(ok, arith.cmpi(arith.CmpIPredicate.sge, index, _i32(0)))
                ok = arith.andi(ok, less(index, n_kv))
                slot = arith.select(ok, index, minus_one)
            if n_window:  # window entry w = e: row w where its flag is set
                safe = arith.minsi(e, _i32(n_window - 1))
                at = arith.addi(valid_base, arith.extui(i64, safe))
                flag = mgpu_utils.inline_ptx("ld.global.nc.u8 $0, [$1];", at, result_types=i32)
                ok = arith.andi(
                    less(e, n_window), arith.cmpi(arith.CmpIPredicate.ne, flag, _i32(0))
                )
                window_slot = arith.select(ok, e, minus_one)
                slot = arith.select(less(e, window_end), window_slot, slot)
            address = arith.addi(dst, arith.shli(e, _i32(2)))
            mgpu_utils.inline_ptx(
                "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p st.shared.u32 [$0], $1; }",
                address,
                slot,
                arith.extui(i32, less(e, total)),
                has_side_effects=True,
            )
        gpu.barrier()  # every thread's slots, before both warpgroups read them

    return build


def _start_loads(
    q_ref, slots_ref, sink_ref, q_smem, slots_smem, sink_smem, load_barriers, b, heads, half
):
    """The two-warpgroup kernels' prologue: starts the copies of this warpgroup's half of q
    and of the sink, and (warpgroup 0) of the slots, one copy that both read (its shared memory
    grows with the keys), or builds the slots from the call's raw arrays (`_RawSlots`); waits
    for the slots and the sink. Returns q's barrier, not awaited (`load_barriers[3 · wg]`)."""
    wg = lax.axis_index("wg")
    q_bar, sink_bar = load_barriers.at[3 * wg], load_barriers.at[3 * wg + 2]
    slots_bar = load_barriers.at[1]
    plgpu.copy_gmem_to_smem(q_ref.at[b, heads, pl.ds(wg * half, half)], q_smem.at[wg], q_bar)
    raw = isinstance(slots_ref, _RawSlots)
    if not raw:

        @pl.when(wg == 0)
        def _():
            plgpu.copy_gmem_to_smem(slots_ref.at[b], slots_smem, slots_bar)

    plgpu.copy_gmem_to_smem(sink_ref.at[heads], sink_smem.at[wg], sink_bar)
    if raw:
        slots_ref.build(slots_ref.valid.at[b], slots_ref.indices.at[b], slots_smem)
    else:
        plgpu.barrier_wait(slots_bar)
    plgpu.barrier_wait(sink_bar)
    return q_bar


def _exchange_kernel(
    q_ref,
    kv_ref,
    win_ref,
    slots_ref,
    sink_ref,
    o_ref,
    lse_ref,
    q_smem,
    k_smem,
    s_smem,
    slots_smem,
    sink_smem,
    lse_smem,
    load_barriers,
    exchange_barrier,
    *optional,
    geometry: _Geometry,
    n_window_chunks: int,
    n_topk_chunks: int,
    splits: int,
    logit_scale: float,
    dequant,
    prefetch: bool,
    gather: str,
    interpret: bool,
    q_overlap: bool = False,
    ablation: str | None = None,
):
    """The default kernel (`TuningConfig(kernel='exchange')`, the module docstring's design):
    one key tile [2 halves, 64, D/2]; per chunk the gather and decode, each warpgroup's partial
    QK^T over its half of D, the two partial logit tiles summed through s_smem, the softmax and
    PV, one after another. `optional` scratch, in this order: the staged gather's slots
    [2 warpgroups, quads, 128, 4] with gather='async', P's buffer in the interpreter.

    With gather='async' the first top-k chunk's copies start before the window's chunks, and
    each top-k chunk starts the next one's after its decode (`_fp4_stage`): the copies fly
    while the chunk's products run. With q_overlap, q's copy is awaited only before the
    split's first QK^T, after its first chunk's gather and decode."""
    optional = list(optional)
    staging = optional.pop(0) if gather == "async" else None
    p_smem = optional.pop(0) if interpret else None
    assert not optional, optional
    b, g, split = lax.axis_index("b"), lax.axis_index("g"), lax.axis_index("split")
    wg = lax.axis_index("wg")
    half = geometry.half
    heads = pl.ds(g * BLOCK_HEADS, BLOCK_HEADS)
    q_bar = _start_loads(
        q_ref, slots_ref, sink_ref, q_smem, slots_smem, sink_smem, load_barriers, b, heads, half
    )
    if not q_overlap:
        plgpu.barrier_wait(q_bar)

    kv_rows, win_rows = kv_ref.at[b], win_ref.at[b]
    dst = k_smem.at[wg]

    def chunk_slots(chunk):
        return slots_smem.at[chunk]

    def attend(chunk, parity, carry, carried):
        """QK^T, the logit exchange, the online softmax and PV for the chunk now in `dst`:
        (acc, m, denom, what the step carries on: `carried()`, called between the softmax and
        PV, so that loads it starts fly while PV runs)."""
        acc, m, denom = carry
        if q_overlap:

            @pl.when(chunk == lo)  # the split's first chunk: q's copy has not been awaited
            def _():
                plgpu.barrier_wait(q_bar)

        plgpu.commit_smem()  # the tile was written by ordinary stores; wgmma reads it async

        def qk(acc_ref):
            plgpu.wgmma(acc_ref, q_smem.at[wg], dst.T)
            return acc_ref[...]

        s_own = pl.run_scoped(qk, plgpu.ACC((BLOCK_HEADS, BLOCK_KV), jnp.float32))
        # Two buffers by chunk parity: a warpgroup rewrites its buffer only after both passed
        # the next chunk's barrier, i.e. after the other one read it.
        s_smem[parity, wg] = s_own
        plgpu.barrier_arrive(exchange_barrier)
        plgpu.barrier_wait(exchange_barrier)
        s_other = plgpu.load(s_smem.at[parity, 1 - wg], layout=plgpu.Layout.WGMMA)
        s = s_own + s_other  # a + b == b + a: both warpgroups get the same logits
        p16, acc, m, denom = _softmax_step(s, chunk_slots(chunk), acc, m, denom, logit_scale)
        raw_out = carried()
        if interpret:
            return _pv_in_interpreter(acc, p16, p_smem.at[wg], dst), m, denom, raw_out

        def pv(acc_ref):  # accumulates onto acc in place; run_state awaits it on exit
            plgpu.wgmma(acc_ref, p16, dst)

        return pl.run_state(pv)(plgpu.ACC.init(acc)), m, denom, raw_out

    def window_step(c, carry):
        dequant.window(win_rows, chunk_slots(c), dst)
        acc, m, denom, raw = carry
        if gather == "behind_pv":  # the first top-k chunk's words, loaded behind this PV
            return attend(c, c % 2, (acc, m, denom), lambda: dequant.load(kv_rows, first_slots))
        return attend(c, c % 2, (acc, m, denom), lambda: raw)

    # The split's chunks [lo, hi) as a window range and a top-k range; consecutive chunks
    # alternate parity across the two loops.
    lo, hi = _split_range(split, splits, n_window_chunks, n_topk_chunks)
    w_lo, w_hi = jnp.minimum(lo, n_window_chunks), jnp.minimum(hi, n_window_chunks)
    k_lo = jnp.maximum(lo, n_window_chunks) - n_window_chunks
    k_hi = jnp.maximum(hi, n_window_chunks) - n_window_chunks

    def topk_step(c, carry):
        acc, m, denom, raw = carry
        chunk = n_window_chunks + c
        nxt = n_window_chunks + jnp.minimum(c + 1, k_hi - 1)
        if ablation == "no_topk_rows":  # TuningConfig.ablation: no gather, no decode
            return attend(chunk, chunk % 2, (acc, m, denom), lambda: raw)
        if gather == "async":  # this chunk's words are staged; stage the next one's
            dequant.store_staged(staging.at[wg], dst, kv_rows, chunk_slots(chunk))
            dequant.stage(kv_rows, chunk_slots(nxt), staging.at[wg])
            return attend(chunk, chunk % 2, (acc, m, denom), lambda: raw)
        if gather == "behind_pv":  # this chunk's words came behind the last PV; load the next
            dequant.store(raw, dst, kv_rows, chunk_slots(chunk))
            next_words = functools.partial(dequant.load, kv_rows, chunk_slots(nxt))
            return attend(chunk, chunk % 2, (acc, m, denom), next_words)
        if prefetch:
            raw_next = dequant.load(kv_rows, chunk_slots(nxt))
        else:
            raw = raw_next = dequant.load(kv_rows, chunk_slots(chunk))
        dequant.store(raw, dst, kv_rows, chunk_slots(chunk))
        return attend(chunk, chunk % 2, (acc, m, denom), lambda: raw_next)

    first = n_window_chunks + jnp.minimum(k_lo, n_topk_chunks - 1)  # always a real chunk
    first_slots = chunk_slots(first)
    acc0, m0, denom0 = _open_softmax(sink_smem.at[wg], half, split)
    if gather == "async":
        dequant.stage(kv_rows, first_slots, staging.at[wg])
        raw0 = None  # nothing carried: the words wait in shared memory
    else:
        raw0 = dequant.load(kv_rows, first_slots)
    carry = lax.fori_loop(w_lo, w_hi, window_step, (acc0, m0, denom0, raw0))
    acc, m, denom, _ = lax.fori_loop(k_lo, k_hi, topk_step, carry)
    if gather == "async":
        dequant.drain()  # the last step's copies (a repeat of its own chunk) were never read
    # q is no longer read: its buffer takes the output.
    _write_output(
        acc,
        m,
        denom,
        q_smem.at[wg],
        o_ref,
        lse_ref,
        lse_smem,
        b=b,
        split=split,
        heads=heads,
        splits=splits,
    )


def _pipelined_kernel(
    q_ref,
    kv_ref,
    win_ref,
    slots_ref,
    sink_ref,
    o_ref,
    lse_ref,
    *refs,
    geometry: _Geometry,
    n_window_chunks: int,
    n_topk_chunks: int,
    splits: int,
    logit_scale: float,
    dequant: _Dequant,
    gather: str,
    merge: bool,
    interpret: bool,
    split_keys: bool = False,
    merge_columns: int | None = None,
):
    """Two key tiles, no logit exchange (`TuningConfig(kernel='pipelined')`): k_smem holds
    [2 tiles, 2 halves of D, 64 keys, D/2]; chunk c lives in tile c % 2. Warpgroup w decodes
    half w of every chunk, as in the exchange kernel, but into the other tile and while its PV
    of the chunk before runs:

    1. at a chunk's start, the loads of the next top-k chunk's words (this thread's share) are
       issued; they fly during the QK^T and the softmax. With gather='async' they are
       `cp.async` copies into this thread's slots of shared memory (`optional`'s first
       scratch, [2 warpgroups, quads, 128, 4]), issued only for a top-k chunk of the split,
       so every group of copies is awaited (by the decode) before the next is issued; else
       loads into registers, which ptxas may move down to their use (at 255 registers it
       did: NOTES.md);
    2. wait until both warpgroups have decoded this chunk (`full_barriers[c % 2]`, 256
       arrivals), then S = Q·K^T over the full D (two wgmma 64×64×D/2: both warpgroups compute
       the same logits, 1.5 times the exchange kernel's tensor work per chunk, but no partial
       logits through shared memory and no barrier between the products);
    3. the online softmax, then PV into this warpgroup's half of the output (K = V, its half
       of the tile), issued and not awaited: the decode of the next chunk into the other tile
       (the window's E4M3 or the loaded words' NVFP4) runs while PV computes, then arrives on
       that tile's barrier.

    A tile is rewritten two chunks after it was read: by this warpgroup's own QK^T and PV,
    awaited (the decode's warpgroup barrier covers its four warps), and by the other
    warpgroup's QK^T, awaited before that one decoded the chunk in between and arrived on the
    barrier this one waited at. Its last PV leaves the tile of the chunk before the last one
    unread, and the output goes through it (q is read by both warpgroups' QK^T).

    With `merge` (`TuningConfig.merge`), `refs` starts with the merged output [B, H, D] and the
    splits of a query and head group are one cluster: after writing its partial, each CTA
    merges its share of the output (`_merge_splits`).

    With `split_keys` (`TuningConfig.qk='keys'`), step 2 computes the logits of this
    warpgroup's 32 keys only (two wgmma 64×32×D/2), and step 3 swaps the row maxima and
    writes P into a shared tile (`_SplitKeys.softmax`), then meets the other warpgroup at
    its P barrier before PV reads P from there: the P tile is rewritten only after both
    passed the next chunk's maxima barrier, i.e. after both PVs of this chunk were awaited."""
    final_ref, *refs = refs if merge else (None, *refs)
    q_smem, k_smem, slots_smem, sink_smem, lse_smem, load_barriers, full_barriers, *optional = refs
    staging = optional.pop(0).at[lax.axis_index("wg")] if gather == "async" else None
    merge_scratch = [optional.pop(0) for _ in range(4)] if merge else None
    if split_keys:  # the P tile, its barriers (maxima, P), the row exchange
        shared = _SplitKeys.take(optional, merge_scratch[0] if merge else None)
    p_smem = optional.pop(0) if interpret else None
    assert not optional, optional
    b, g, split = lax.axis_index("b"), lax.axis_index("g"), lax.axis_index("split")
    wg = lax.axis_index("wg")
    half = geometry.half
    heads = pl.ds(g * BLOCK_HEADS, BLOCK_HEADS)
    _start_loads(
        q_ref, slots_ref, sink_ref, q_smem, slots_smem, sink_smem, load_barriers, b, heads, half
    )
    kv_rows, win_rows = kv_ref.at[b], win_ref.at[b]
    lo, hi = _split_range(split, splits, n_window_chunks, n_topk_chunks)

    def chunk_slots(chunk):
        return slots_smem.at[chunk]

    def load(chunk):
        """Starts bringing this thread's words of `chunk`: with gather='async' its copies
        into `staging` where `chunk` is a top-k chunk of the split (None comes back); else its
        loads into registers, clamped to a real top-k chunk (for a window chunk, decoded from
        its rows, or past the split, the words go unused)."""
        if gather == "async":

            @pl.when((chunk >= n_window_chunks) & (chunk < hi))
            def _():
                dequant.stage(kv_rows, chunk_slots(chunk), staging)

            return None
        topk = jnp.clip(chunk - n_window_chunks, 0, n_topk_chunks - 1)
        return dequant.load(kv_rows, chunk_slots(n_window_chunks + topk))

    def decode(chunk, raw):
        """Writes this warpgroup's half of `chunk` into its tile and arrives on its barrier."""
        tile = chunk % 2
        dst = k_smem.at[tile, wg]

        @pl.when(chunk < n_window_chunks)
        def _():
            dequant.window(win_rows, chunk_slots(chunk), dst)

        @pl.when(chunk >= n_window_chunks)
        def _():
            if gather == "async":
                dequant.store_staged(staging, dst, kv_rows, chunk_slots(chunk))
            else:
                dequant.store(raw, dst, kv_rows, chunk_slots(chunk))

        plgpu.commit_smem()  # ordinary stores, read by the wgmmas (the async proxy)
        plgpu.barrier_arrive(full_barriers.at[tile])

    decode(lo, load(lo))
    for other in range(2):  # QK^T reads both halves of q
        plgpu.barrier_wait(load_barriers.at[3 * other])

    def step(c, carry):
        acc, m, denom = carry
        raw_next = load(c + 1)
        tile = k_smem.at[c % 2]
        plgpu.barrier_wait(full_barriers.at[c % 2])

        keys = pl.ds(pl.multiple_of(wg * HALF_KV, HALF_KV), HALF_KV) if split_keys else slice(None)

        def qk(s_ref):
            for h in range(2):
                plgpu.wgmma(s_ref, q_smem.at[h], tile.at[h, keys].T)
            return s_ref[...]

        n_keys = HALF_KV if split_keys else BLOCK_KV
        s = pl.run_scoped(qk, plgpu.ACC((BLOCK_HEADS, n_keys), jnp.float32))

        def decode_next():
            @pl.when(c + 1 < hi)
            def _():
                decode(c + 1, raw_next)

        if split_keys:
            acc, m, denom = shared.softmax(s, chunk_slots(c), acc, m, denom, logit_scale, interpret)
            if interpret:  # no `run_state` there: a fresh product, added
                acc = acc + _pv_fresh(shared.p_tile, tile.at[wg], acc.shape)
                decode_next()
                return acc, m, denom

            def pv_shared(acc_ref):  # P from the shared tile; the next decode meanwhile
                plgpu.wgmma(acc_ref, shared.p_tile, tile.at[wg])
                decode_next()

            return pl.run_state(pv_shared)(plgpu.ACC.init(acc)), m, denom

        p16, acc, m, denom = _softmax_step(s, chunk_slots(c), acc, m, denom, logit_scale)
        if interpret:
            acc = _pv_in_interpreter(acc, p16, p_smem.at[wg], tile.at[wg])
            decode_next()
            return acc, m, denom

        def pv(acc_ref):  # the next chunk's decode runs while the wgmma does
            plgpu.wgmma(acc_ref, p16, tile.at[wg])
            decode_next()

        return pl.run_state(pv)(plgpu.ACC.init(acc)), m, denom

    acc, m, denom = _open_softmax(sink_smem.at[wg], half, split)
    if split_keys:
        denom = _SplitKeys.sink_share(denom, wg)
    acc, m, denom = lax.fori_loop(lo, hi, step, (acc, m, denom))
    if split_keys:  # both warpgroups' shares of the row sums
        denom = shared.sum_rows(denom)
        if merge:  # the exchange's stores, before a bulk copy rewrites them (`lse_stage`)
            plgpu.commit_smem()
    _write_output(
        acc,
        m,
        denom,
        k_smem.at[hi % 2, wg],
        o_ref,
        lse_ref,
        lse_smem,
        b=b,
        split=split,
        heads=heads,
        splits=splits,
    )
    if merge:
        _merge_splits(
            o_ref,
            lse_ref,
            final_ref,
            k_smem,
            q_smem,
            *merge_scratch,
            b=b,
            split=split,
            heads=heads,
            splits=splits,
            half=half,
            pass_columns=merge_columns,
        )


SHARED_MEMORY_BYTES = 232_448
"""Shared memory one CTA may take on sm_90 (227 KB)."""

MOSAIC_SHARED_OVERHEAD = 4_288
"""Bytes Mosaic GPU's allocation adds to the pipelined kernel's scratch buffers (alignment, its
own use), measured by lowering for the H200 with jax 0.11.2: at D = 512 it lowers with 48
chunks' slots and its staged words, and refuses 49 (`tests/test_kernel_lowering.py` checks
both sides; 40 and 41 before the staged scale words were packed, fifteenth session)."""


def pipelined_shared_bytes(
    geometry: _Geometry,
    n_chunks: int,
    gather: str,
    merge_splits: int = 0,
    split_keys: bool = False,
) -> int:
    """Shared memory of the pipelined kernel over `n_chunks` chunks of slots: q, two key tiles,
    the slots, the sink and the log-sum-exp, the barriers, the staged words with
    gather='async', the merge's log-sum-exps and barriers where it merges `merge_splits`
    splits, the P tile, the row exchange (none of its own when merging: it goes through the
    merge's log-sum-exps) and its two barriers with `split_keys` (qk='keys'), and
    `MOSAIC_SHARED_OVERHEAD`."""
    scratch = 2 * BLOCK_HEADS * geometry.half * 2  # q, bf16
    scratch += 2 * 2 * BLOCK_KV * geometry.half * 2  # two key tiles, both halves
    scratch += n_chunks * BLOCK_KV * 4 + 3 * BLOCK_HEADS * 4 + 8 * 8  # slots, sink, lse, barriers
    if gather == "async":
        scratch += math.prod(geometry.staging_shape) * 4
    if merge_splits:  # the log-sum-exps (Mosaic GPU took 1 KB for them) and three barriers
        scratch += _round_up(merge_splits * BLOCK_HEADS * 4, 1024) + 3 * 8
    if split_keys:  # the P tile, two barriers; the row exchange (with them, Mosaic GPU took
        # 1 KB) unless it goes through the merge's log-sum-exps
        scratch += BLOCK_HEADS * BLOCK_KV * 2 + (2 * 8 if merge_splits else 1024)
    return scratch + MOSAIC_SHARED_OVERHEAD


def resolve_pipelined(
    config: TuningConfig, splits: int, dim: int, n_chunks: int
) -> tuple[str, bool]:
    """(gather, split keys) of a pipelined-kernel call over `n_chunks` chunks of a `dim`-wide
    latent at `splits` splits (`TuningConfig.gather_for`, `TuningConfig.qk`): the staged gather
    where it is preferred and fits in shared memory beside the slots (and the merge's buffers,
    `merges_in_kernel`, and the P tile with the split keys), registers beyond. Left to choose,
    the keys are split unless only the full logits leave room for a preferred staged gather
    (at D = 512, past 12 chunks at one split) or the P tile does not fit at all."""
    merge_splits = splits if config.merges_in_kernel(splits) else 0

    def fits(gather: str, split_keys: bool) -> bool:
        needs = pipelined_shared_bytes(
            _Geometry.of(dim), n_chunks, gather, merge_splits, split_keys
        )
        return needs <= SHARED_MEMORY_BYTES

    def gather(split_keys: bool) -> str:
        return config.gather_for(splits, staging_fits=fits("async", split_keys))

    if config.qk is not None:
        return gather(config.qk == "keys"), config.qk == "keys"
    with_keys, with_heads = gather(True), gather(False)
    if with_keys == with_heads and fits(with_keys, True):
        return with_keys, True
    return with_heads, False


def _round_up(n: int, k: int) -> int:
    return -(-n // k) * k


def _pad_chunks(slots: jax.Array) -> jax.Array:
    """[B, n] slots padded with −1 to whole chunks of BLOCK_KV."""
    extra = _round_up(slots.shape[1], BLOCK_KV) - slots.shape[1]
    return jnp.pad(slots, ((0, 0), (0, extra)), constant_values=-1)


def fp4_sparse_attention_mgpu(
    q: jax.Array,
    kv_packed: jax.Array,
    indices: jax.Array,
    window_packed: jax.Array,
    window_valid: jax.Array,
    sink: jax.Array,
    *,
    kv_fmt: str = "nvfp4",
    window_fmt: str = "fp8",
    scale: float | None = None,
    config: TuningConfig = TuningConfig(),
    interpret: bool = False,
) -> jax.Array:
    """Mosaic GPU forward of `v41jax.ops.attention.packed_sparse_attention` (validated
    arguments, a call `supports` takes).

    Args:
      q: [B, H, D] queries, any float dtype (cast to bf16).
      kv_packed: [B, S, D/2 + D/16] uint8 NVFP4 rows of each query's compressed cache.
      indices: [B, K] int32 rows of kv_packed; −1 (any value outside [0, S)) skips the slot.
      window_packed: [B, W, D + D/32] uint8 FP8 window rows.
      window_valid: [B, W] bool.
      sink: [H] float32 sink logits.
      kv_fmt, window_fmt: 'nvfp4' and 'fp8' (the only formats this kernel decodes).
      scale: logit scale, a Python float (default D^-0.5).
      config: `TuningConfig`.
      interpret: run on CPU through Mosaic GPU interpret mode (forces dequant='jnp').

    Returns:
      [B, H, D] bfloat16.
    """
    batch, n_heads, dim = q.shape
    supported = supports(kv_fmt=kv_fmt, window_fmt=window_fmt, dim=dim)
    if not supported:
        raise supported.error()
    dequant_kind = "jnp" if interpret else config.dequant
    geometry = _Geometry.of(dim)
    scale = dim**-0.5 if scale is None else scale
    n_kv, n_window, n_topk = kv_packed.shape[1], window_packed.shape[1], indices.shape[1]

    heads = _round_up(max(n_heads, 1), BLOCK_HEADS)
    q = jnp.pad(q.astype(jnp.bfloat16), ((0, 0), (0, heads - n_heads), (0, 0)))
    # The sink as given (no XLA op for 64 heads of float32): the kernel takes it to the log2
    # domain and keeps it for split 0 (`_open_softmax`).
    sink = jnp.pad(sink.astype(jnp.float32), (0, heads - n_heads), constant_values=-1e30)
    # Slots: the row of each key slot in its own array, −1 to skip; padded to whole chunks.
    window_slots = jnp.where(window_valid, jnp.arange(n_window, dtype=jnp.int32), -1)
    topk_slots = jnp.where((indices >= 0) & (indices < n_kv), indices, -1).astype(jnp.int32)
    if n_topk == 0:  # one empty chunk keeps the top-k loop (and its prefetch) non-empty
        topk_slots = jnp.full((batch, BLOCK_KV), -1, jnp.int32)
    # [B, chunks, 64]: a TMA box spans at most 256 elements per dimension.
    slots = jnp.concatenate([_pad_chunks(window_slots), _pad_chunks(topk_slots)], axis=1)
    slots = slots.reshape(batch, -1, BLOCK_KV)
    n_window_chunks = _round_up(n_window, BLOCK_KV) // BLOCK_KV
    n_topk_chunks = _round_up(topk_slots.shape[1], BLOCK_KV) // BLOCK_KV
    splits = config.splits
    if splits is None:
        n_sms = 1 if interpret else getattr(jax.devices()[0], "core_count", 1)
        splits = max(1, min(4, n_sms // (batch * heads // BLOCK_HEADS)))
    splits = min(splits, n_window_chunks + n_topk_chunks)
    # A clamped −1 slot still reads row 0: give empty arrays one zero row.
    if n_kv == 0:
        kv_packed = jnp.zeros((batch, 1, geometry.kv_row_bytes), jnp.uint8)
    if n_window == 0:
        window_packed = jnp.zeros((batch, 1, geometry.window_row_bytes), jnp.uint8)

    if config.merge_columns is not None and geometry.half % config.merge_columns:
        raise ValueError(
            f"config.merge_columns: expected a divisor of D/2 = {geometry.half}, got "
            f"{config.merge_columns}"
        )
    if config.ablation in ("no_topk_gather", "no_topk_decode") and dequant_kind != "ptx":
        raise ValueError(
            f"config.ablation: {config.ablation!r} leaves a step out of the PTX decode; it "
            f"needs dequant='ptx' on the GPU, got dequant={dequant_kind!r}"
            + " (interpret mode)"
            * interpret
        )
    if dequant_kind == "ptx":
        make_dequant = functools.partial(_ptx_dequant, ablation=config.ablation)
    else:
        make_dequant = _jnp_dequant
    half = geometry.half
    n_chunks = slots.shape[1]
    statics = dict(
        geometry=geometry,
        n_window_chunks=n_window_chunks,
        n_topk_chunks=n_topk_chunks,
        splits=splits,
        logit_scale=scale * _LOG2E,
        interpret=interpret,
    )
    # Shared memory (D = 512, 10 chunks): q 64 KB, then keys 128 KB (two tiles: the
    # specialized and the pipelined kernel) or keys 64 KB and the logit exchange 64 KB (the
    # first kernel), the slots 2.5 KB (one copy all warpgroups read); the
    # staged gather's words 18 KB (gather='async'); the split keys' P tile 8 KB (qk='keys').
    optional = []  # scratch after the barriers, before P's buffer in the interpreter
    # The interpreter runs a cluster's barrier waits on XLA's CPU runtime threads (two on a
    # 2-core machine), and a cluster of 2 to 4 CTAs of 2 warpgroups waiting at one barrier
    # deadlocked there: interpreted, the splits merge in XLA.
    merge = config.merges_in_kernel(splits) and not interpret
    if config.kernel == "pipelined":
        gather, split_keys = resolve_pipelined(config, splits, dim, n_chunks)
        kernel = functools.partial(
            _pipelined_kernel,
            dequant=make_dequant(geometry),
            gather=gather,
            merge=merge,
            split_keys=split_keys,
            merge_columns=config.merge_columns,
            **statics,
        )
        warpgroups = 2
        middle = [
            plgpu.SMEM((2, 2, BLOCK_KV, half), jnp.bfloat16, transforms=_TILE),
            plgpu.SMEM((n_chunks, BLOCK_KV), jnp.int32),  # both warpgroups read one copy
        ]
        barriers = [
            plgpu.Barrier(num_barriers=6),
            plgpu.Barrier(num_arrivals=2, num_barriers=2),  # a tile decoded: both warpgroups
        ]
        if gather == "async":  # `_pipelined_kernel`'s optional scratch, first
            optional.append(plgpu.SMEM(geometry.staging_shape, jnp.int32))
        if merge:  # then `_merge_splits`' log-sum-exps and barriers
            optional += _merge_scratch(splits)
        if split_keys:  # then the P tile, its barriers and (merging: the merge's) the rows
            optional += _SplitKeys.scratch(interpret, rows=not merge)
    elif config.kernel == "specialized":
        dequant = tuple(make_dequant(geometry, h) for h in range(2))
        gather = config.gather_for(splits)
        split_keys = config.qk == "keys"
        kernel = functools.partial(
            _specialized_kernel,
            dequant=dequant,
            gather=gather,
            split_keys=split_keys,
            producers=config.producers,
            registers=config.registers or SPECIALIZED_REGISTERS[config.producers],
            merge=merge,
            merge_columns=config.merge_columns,
            **statics,
        )
        warpgroups = 2 + config.producers
        middle = [
            plgpu.SMEM((2, 2, BLOCK_KV, half), jnp.bfloat16, transforms=_TILE),
            plgpu.SMEM((n_chunks, BLOCK_KV), jnp.int32),  # every warpgroup reads one copy
        ]
        barriers = [
            plgpu.Barrier(num_barriers=6),  # consumer w's q (3w) and sink (3w + 2); slots (1)
            plgpu.Barrier(num_arrivals=config.producers, num_barriers=2),  # full: each producer
            plgpu.Barrier(num_arrivals=2, num_barriers=2),  # empty: both consumers
            plgpu.Barrier(num_arrivals=2),  # done
        ]
        if gather == "async":  # `_specialized_kernel`'s optional scratch, first
            optional.append(plgpu.SMEM(geometry.staging_shape, jnp.int32))
        if merge:  # then `_merge_splits`' log-sum-exps and barriers
            optional += _merge_scratch(splits)
        if split_keys:  # then the P tile, its barriers and (merging: the merge's) the rows
            optional += _SplitKeys.scratch(interpret, rows=not merge)
    else:
        gather = config.gather_for(splits)
        kernel = functools.partial(
            _exchange_kernel,
            dequant=make_dequant(geometry),
            prefetch=config.prefetch,
            gather=gather,
            q_overlap=config.q_overlap,
            ablation=config.ablation,
            **statics,
        )
        warpgroups = 2
        middle = [
            plgpu.SMEM((2, BLOCK_KV, half), jnp.bfloat16, transforms=_TILE),
            plgpu.SMEM((2, 2, BLOCK_HEADS, BLOCK_KV), jnp.float32, transforms=_F32_TILE),
            plgpu.SMEM((n_chunks, BLOCK_KV), jnp.int32),  # both warpgroups read one copy
        ]
        barriers = [plgpu.Barrier(num_barriers=6), plgpu.Barrier(num_arrivals=2)]
        if gather == "async":  # `_exchange_kernel`'s optional scratch, first
            optional.append(plgpu.SMEM(geometry.staging_shape, jnp.int32))
    out_type = [
        jax.ShapeDtypeStruct((batch, splits, heads, dim), jnp.bfloat16),
        jax.ShapeDtypeStruct((batch, splits, heads), jnp.float32),
    ]
    if merge:  # the splits of a (query, head group): one cluster, which merges them
        out_type.append(jax.ShapeDtypeStruct((batch, heads, dim), jnp.bfloat16))
        mesh = dict(
            grid=(batch, heads // BLOCK_HEADS),
            grid_names=("b", "g"),
            cluster=(splits,),
            cluster_names=("split",),
        )
    else:
        mesh = dict(grid=(batch, heads // BLOCK_HEADS, splits), grid_names=("b", "g", "split"))
    inputs = (q, kv_packed, window_packed, slots, sink)
    if config.builds_slots() and dequant_kind == "ptx":
        # The slots built in the kernel from the arrays as given (`_slot_builder`): the XLA op
        # above that made them is then unused, and not run.
        build = _slot_builder(
            n_window=n_window,
            n_topk=n_topk,
            n_kv=n_kv,
            n_window_chunks=n_window_chunks,
            n_chunks=n_chunks,
            warpgroups=warpgroups,
        )
        valid = window_valid if n_window else jnp.zeros((batch, 1), jnp.bool_)
        index = indices.astype(jnp.int32) if n_topk else jnp.full((batch, 1), -1, jnp.int32)
        inputs = (q, kv_packed, window_packed, valid, index, sink)
        with_slots = kernel

        def kernel(q_ref, kv_ref, win_ref, valid_ref, index_ref, *refs):
            with_slots(q_ref, kv_ref, win_ref, _RawSlots(valid_ref, index_ref, build), *refs)

    out, lse, *merged = plgpu.kernel(
        kernel,
        out_type=tuple(out_type),
        **mesh,
        num_threads=warpgroups,
        thread_name="wg",
        scratch_types=[
            plgpu.SMEM((2, BLOCK_HEADS, half), jnp.bfloat16, transforms=_TILE),
            *middle,
            plgpu.SMEM((2, BLOCK_HEADS), jnp.float32),
            plgpu.SMEM((BLOCK_HEADS,), jnp.float32),
            *barriers,
            *optional,
            *([plgpu.SMEM((2, BLOCK_HEADS, BLOCK_KV), jnp.bfloat16, transforms=_TILE)] * interpret),
        ],
        compiler_params=plgpu.CompilerParams(approx_math=True),
        # The interpreter checks the kernel's shared-memory accesses for races (CPU tests).
        interpret=plgpu.InterpretGPUParams(detect_races=True) if interpret else False,
    )(*inputs)
    if merge:
        return merged[0][:, :n_heads]
    if splits > 1:
        out = _combine_splits(out, lse)
    return out[:, 0, :n_heads]


def _combine_splits(
    out: Float[Array, "batch split head dim"], lse: Float[Array, "batch split head"]
) -> Float[Array, "batch 1 head dim"]:
    """Merges split-KV partial outputs (each normalized by its own sum) by their log2-sum-exp;
    a split without any key has −inf and weight 0; all −inf (an empty row, no sink) gives 0.

    As an einsum after the weights: on the H200 at batch 64 its two XLA ops took 1.1 + 3.2 µs.
    Written split by split without a reduction over the split axis (the seventh session),
    they took 1.0 + 3.7 µs, so this form stayed
    (`results/bench_sparse_attention_h200_2026-12-04_attention_async.json`, `kernels_us`)."""
    top = jnp.max(lse, axis=1, keepdims=True)
    weight = jnp.exp2(lse - jnp.where(top > -jnp.inf, top, 0.0))
    total = jnp.sum(weight, axis=1, keepdims=True)
    weight = weight / jnp.where(total > 0, total, 1.0)
    merged = jnp.einsum("bsh,bshd->bhd", weight, out.astype(jnp.float32))
    return merged[:, None].astype(out.dtype)
