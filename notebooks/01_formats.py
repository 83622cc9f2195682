# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 01 — The FP4 / FP8 KV formats
#
# DeepSeek-V4.1 stores its main (compressed) KV cache in FP4: E2M1 elements with one E4M3
# scale per 16 values ("NVFP4"), 288 bytes per 512-dim entry. The indexer keys use MXFP4
# (E2M1, one power-of-two E8M0 scale per 32 values), and the sliding-window KV uses FP8 E4M3
# with one power-of-two scale per 32 values. The exact rules are in `DESIGN.md` §4; everything
# below is computed by `v41jax.ops.formats` (fake-quant and real packing) and `v41jax.accounting`
# (byte tables); the notebook only measures and draws.
#
# What this notebook shows:
# 1. the E2M1 grid and how ties round (to the even code);
# 2. the quantization error of the three scale rules on three kinds of data;
# 3. the error as the input scale sweeps 10 orders of magnitude — where the E4M3 scale of NVFP4
#    underflows and saturates;
# 4. the packed rows byte by byte, from real `formats.pack` output;
# 5. what this means for KV bytes per token.
#
# Set `V41JAX_SMOKE=1` to run everything at a tiny size (what CI does).

# %%
import functools
import os

import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import ml_dtypes
import numpy as np

from v41jax import accounting, tables
from v41jax.nn import config
from v41jax.ops import formats

SMOKE = os.environ.get("V41JAX_SMOKE", "0") == "1"
ROWS = 64 if SMOKE else 4096  # rows of 512 values per data set
SWEEP_ROWS = 8 if SMOKE else 256  # rows per point of the scale sweep
SWEEP_POINTS = 21 if SMOKE else 81  # input scales from 1e-6 to 1e4
DIM = 512  # V4.1's main-KV width
FORMATS = ("nvfp4", "mxfp4", "fp8")  # main KV, indexer q/k, window KV (DESIGN §4)
COLORS = {"nvfp4": "tab:blue", "mxfp4": "tab:orange", "fp8": "tab:green", "bf16": "tab:gray"}
key = jax.random.key(0)
print(f"SMOKE={SMOKE}: {ROWS} rows x {DIM} values per data set")

# The library functions run eagerly op by op; jitting them once per shape is much faster here.
e2m1_round = jax.jit(formats.e2m1_round)
e2m1_codes = jax.jit(formats.e2m1_codes)
pack = jax.jit(formats.pack, static_argnames="fmt")
unpack = jax.jit(formats.unpack, static_argnames="fmt")
fake_quant = jax.jit(formats.fake_quant, static_argnames="fmt")

# %% [markdown]
# ## 1. The E2M1 grid
#
# An E2M1 nibble is a sign bit, two exponent bits and one mantissa bit: eight magnitudes
# {0, 0.5, 1, 1.5, 2, 3, 4, 6}. The library's decode table (what a kernel uses as a lookup)
# lists all 16 codes; code 8 is −0.

# %%
table = np.asarray(formats.e2m1_decode_table())
for code in range(16):
    print(f"nibble {code:2d} = 0b{code:04b} -> {table[code]:+.1f}")

# %% [markdown]
# `formats.e2m1_round` rounds to the nearest grid value and saturates at ±6. A value exactly
# halfway between two neighbours goes to the one whose code is even (mantissa bit 0), which is
# not always the smaller one: 0.75 → 1 and 1.75 → 2 round *up*, while 2.5 → 2 and 5 → 4 round
# down. The midpoints below come from the decode table, not from a typed-in list.

# %%
grid = np.unique(np.abs(table))
ties = (grid[:-1] + grid[1:]) / 2
rounded = np.asarray(e2m1_round(jnp.asarray(ties, jnp.float32)))
codes = np.asarray(e2m1_codes(jnp.asarray(ties, jnp.float32)))
for lo, hi, tie, r, c in zip(grid[:-1], grid[1:], ties, rounded, codes, strict=True):
    print(f"tie {tie:5.2f} between {lo:3.1f} and {hi:3.1f} -> {r:3.1f} (code {c}, even)")

x = jnp.linspace(-7.0, 7.0, 2801, dtype=jnp.float32)
fig, ax = plt.subplots(figsize=(8, 4))
ax.plot(x, e2m1_round(x), lw=1.5, label="e2m1_round(x)")
ax.plot(x, x, ":", color="gray", lw=1, label="x")
ax.scatter(ties, rounded, color="crimson", zorder=3, label="ties (round to even code)")
ax.scatter(-ties, -rounded, color="crimson", zorder=3)
for i, (tie, r) in enumerate(zip(ties, rounded, strict=True)):
    offset = (6, -12) if i % 2 == 0 else (-30, 8)  # alternate sides so the labels do not collide
    ax.annotate(f"{tie:g}→{r:g}", (tie, r), textcoords="offset points", xytext=offset, fontsize=7)
ax.set(xlabel="x", ylabel="rounded", title="E2M1 rounding: nearest even, saturating at ±6")
ax.grid(alpha=0.3)
ax.legend(loc="upper left", fontsize=8)
plt.show()

# %% [markdown]
# ## 2. Quantization error of the three scale rules
#
# The three formats differ in the element (E2M1 vs E4M3), the group that shares a scale (16 vs
# 32 values) and how precise the scale is (an E4M3 number vs a bare power of two):
#
# | format | group | scale | element |
# |---|---|---|---|
# | NVFP4 (main KV) | 16 | E4M3 (3 mantissa bits) | E2M1 |
# | MXFP4 (indexer q/k) | 32 | E8M0 (power of two) | E2M1 |
# | FP8 window | 32 | UE8M0 (power of two) | E4M3 |
#
# We measure the relative MSE ‖x − q(x)‖² / ‖x‖² and the SQNR = −10·log10(relative MSE) on
# rows of 512 values drawn three ways (right panel: the same, but only over the ordinary
# channels, since the few outliers dominate ‖x‖² and hide what happens to everything else):
# - **Gaussian**: the easy case;
# - **Student-t (ν = 3)**: heavy tails, so a group's largest value often sits far above the rest;
# - **outlier channels**: Gaussian, but 4 fixed channels out of 512 are 30× larger in every row
#   (the pattern attention keys often show). A group that holds an outlier scales everything
#   else in the group down towards zero.
#
# BF16 is shown as the reference for "no block quantization".

# %%
k_gauss, k_t, k_out = jax.random.split(key, 3)
gauss = jax.random.normal(k_gauss, (ROWS, DIM), jnp.float32)
student = jax.random.t(k_t, 3.0, (ROWS, DIM), jnp.float32)
channel_gain = jnp.ones(DIM).at[jnp.array([7, 100, 300, 451])].set(30.0)
outliers = jax.random.normal(k_out, (ROWS, DIM), jnp.float32) * channel_gain
datasets = {"Gaussian": gauss, "Student-t (ν=3)": student, "outlier channels": outliers}


@functools.partial(jax.jit, static_argnames="fmt")
def relative_mse(x, fmt, channels=None):
    """‖x − fake_quant(x)‖² / ‖x‖² over the last two axes, optionally only over `channels`
    (a bool mask of the last axis); the quantization itself always sees the whole row."""
    err = (formats.fake_quant(x, fmt) - x) ** 2
    power = x**2
    if channels is not None:
        err, power = jnp.where(channels, err, 0.0), jnp.where(channels, power, 0.0)
    return jnp.sum(err, axis=(-2, -1)) / jnp.sum(power, axis=(-2, -1))


compared = (*FORMATS, "bf16")
ordinary = channel_gain == 1.0
rel_mse = {
    (subset, d, f): float(relative_mse(x, f, None if subset == "all" else ordinary))
    for subset in ("all", "ordinary")
    for d, x in datasets.items()
    for f in compared
}
for subset in ("all", "ordinary"):
    print(f"relative MSE (SQNR) over {subset} channels")
    print(f"{'data':<18}" + "".join(f"{f:>22}" for f in compared))
    for d in datasets:
        cells = [
            f"{rel_mse[subset, d, f]:.2e} ({-10 * np.log10(rel_mse[subset, d, f]):5.1f} dB)"
            for f in compared
        ]
        print(f"{d:<18}" + "".join(f"{c:>22}" for c in cells))

# %%
fig, axes = plt.subplots(1, 2, figsize=(13, 4), sharey=True)
width = 0.8 / len(compared)
for ax, subset in zip(axes, ("all", "ordinary"), strict=True):
    for i, f in enumerate(compared):
        sqnr = [-10 * np.log10(rel_mse[subset, d, f]) for d in datasets]
        x_pos = np.arange(len(datasets)) + i * width
        bars = ax.bar(x_pos, sqnr, width, label=f, color=COLORS[f])
        ax.bar_label(bars, fmt="%.1f", fontsize=7)
    ax.set_xticks(np.arange(len(datasets)) + width * (len(compared) - 1) / 2, list(datasets))
    ax.set_title(f"SQNR over {subset} channels")
    ax.grid(axis="y", alpha=0.3)
axes[0].set_ylabel("SQNR (dB, higher is better)")
axes[0].legend(fontsize=8)
plt.show()

# %% [markdown]
# What to read from it: the two FP4 formats sit more than 10 dB below FP8 (E2M1 has 1 mantissa bit,
# E4M3 has 3). Between the two FP4 formats, NVFP4's smaller groups and finer scale win
# everywhere, and the gap widens with heavy tails and outliers. The right panel shows the cost
# of an outlier channel: every group that holds one is scaled for the outlier, so its ordinary
# values land on the bottom of the grid or round to zero. With groups of 32 and a power-of-two
# scale that can overshoot the group's maximum by up to 2×, MXFP4 loses more of them.
#
# ## 3. Error versus input scale
#
# Block formats are meant to be scale-free: multiply the data by 1000 and the scale absorbs it.
# That only holds while the scale itself is representable. The E4M3 scale of NVFP4,
# s = e4m3(max(amax, 6·2⁻⁹)/6), has a narrow range (E4M3 facts below from `ml_dtypes.finfo`):
# - for amax/6 below E4M3's smallest normal (2⁻⁶) the scale is a subnormal with fewer
#   significant bits, so it fits the group's maximum less tightly (shaded band);
# - below the amax floor 6·2⁻⁹ the scale is pinned at 2⁻⁹, no longer follows the data, and
#   once values are under a quarter of it they all round to zero (relative MSE → 1);
# - above 448·6 the scale saturates at 448 and the elements are clamped at ±6.
#
# MXFP4 and the FP8 window format use a power-of-two scale with an 8-bit exponent, which covers
# the whole range shown here. We multiply fixed Gaussian rows by scales from 1e-6 to 1e4 and
# measure the relative MSE; the markers on the x axis convert the group maxima above into input
# scales with the median largest |value| of a 16-value group of these rows.

# %%
scales = np.logspace(-6, 4, SWEEP_POINTS).astype(np.float32)
base = jax.random.normal(jax.random.key(1), (SWEEP_ROWS, DIM), jnp.float32)
# One array [scale, row, dim]: groups lie along the last axis, so every scale is independent.
sweep = jnp.asarray(scales)[:, None, None] * base
sweep_mse = {f: np.asarray(relative_mse(sweep, f)) for f in FORMATS}

e4m3 = ml_dtypes.finfo(ml_dtypes.float8_e4m3fn)
floor = formats.FORMATS["nvfp4"].amax_floor  # 6 · 2⁻⁹, the smallest E4M3 subnormal times 6
nvfp4_max = float(fake_quant(jnp.full((16,), 1e30, jnp.float32), "nvfp4").max())
group_amax = float(jnp.median(jnp.max(jnp.abs(base.reshape(-1, 16)), axis=-1)))
print(f"E4M3: max {float(e4m3.max)}, smallest normal {float(e4m3.smallest_normal)}")
print(f"NVFP4 amax floor {floor:.4g}; largest storable value {nvfp4_max:g}")
print(f"median group amax = {group_amax:.2f} x input scale")

fig, ax = plt.subplots(figsize=(9, 4.5))
for f in FORMATS:
    ax.loglog(scales, np.maximum(sweep_mse[f], 1e-12), "o-", ms=3, label=f, color=COLORS[f])
subnormal_top = 6 * float(e4m3.smallest_normal) / group_amax
ax.axvspan(floor / group_amax, subnormal_top, color=COLORS["nvfp4"], alpha=0.1)
ax.text(subnormal_top, 1.5, "E4M3 subnormal scale ", fontsize=8, ha="right", va="top")
for where, label in ((floor, "amax floor 6·2⁻⁹"), (nvfp4_max, f"saturation {nvfp4_max:g}")):
    ax.axvline(where / group_amax, ls="--", color=COLORS["nvfp4"], alpha=0.6)
    ax.text(where / group_amax, 3e-5, f" {label}", fontsize=8, rotation=90, va="bottom")
ax.set(
    xlabel="input scale (std of the Gaussian rows)",
    ylabel="relative MSE",
    title="Error vs input scale: NVFP4's E4M3 scale underflows and saturates",
    ylim=(1e-5, 3),
)
ax.grid(alpha=0.3, which="both")
ax.legend(fontsize=8, loc="center left")
plt.show()

# %% [markdown]
# Inside its range NVFP4 is the more accurate FP4 format; outside it, it degrades fast: its
# error climbs through the subnormal-scale band, every value rounds to zero for inputs around
# 1e-4 and below, and beyond a few thousand the values are clamped. In the model the main KV is
# RMS-normalized before it is stored, which keeps it in the flat part of the curve. MXFP4 and
# FP8 stay flat across the whole sweep.
#
# ## 4. The packed rows, byte by byte
#
# `formats.pack` produces the real cache bytes (the official reference only simulates FP4 in
# BF16). A row is the element bytes first, then the scale bytes:
# - **NVFP4**, D = 512: 256 bytes holding two E2M1 nibbles each (element 2i in the low nibble,
#   2i+1 in the high one), then 32 E4M3 scale bytes, one per group of 16 → **288 B**;
# - **MXFP4** index key, D = 128: 64 nibble-pair bytes + 4 E8M0 scale bytes → **68 B**;
# - **FP8** window row, D = 512: 512 E4M3 bytes + 16 UE8M0 scale bytes → **528 B**.
#
# Unpacking gives exactly the fake-quant values (checked below), so training with fake-quant
# and serving from packed bytes see the same numbers.

# %%
row_dims = {"nvfp4": 512, "mxfp4": 128, "fp8": 512}
row = jax.random.normal(jax.random.key(2), (DIM,), jnp.float32)
packed = {f: np.asarray(pack(row[:d], f)) for f, d in row_dims.items()}
for f, d in row_dims.items():
    same = np.array_equal(np.asarray(unpack(packed[f], f)), np.asarray(fake_quant(row[:d], f)))
    fmt = formats.FORMATS[f]
    data_bytes = d * (4 if fmt.element == "e2m1" else 8) // 8
    print(
        f"{f:>5}: D={d}: {packed[f].size} bytes = {data_bytes} element bytes + "
        f"{packed[f].size - data_bytes} scale bytes (packed_row_bytes: "
        f"{formats.packed_row_bytes(f, d)}); unpack(pack(x)) == fake_quant(x): {same}"
    )

# %% [markdown]
# The NVFP4 row as a grid of 18 × 16 bytes: each of the first 16 lines holds 32 values (two
# groups of 16), the last two lines are the 32 E4M3 scales. Each cell shows the byte in hex;
# element bytes are coloured by the magnitude of their two nibbles, scale bytes by the decoded
# scale.

# %%
nv = packed["nvfp4"]
lo_nibble, hi_nibble = nv[:256] & 0xF, nv[:256] >> 4
magnitude = np.abs(table[lo_nibble]) + np.abs(table[hi_nibble])
scales_e4m3 = nv[256:].view(ml_dtypes.float8_e4m3fn).astype(np.float32)

fig, ax = plt.subplots(figsize=(11, 7))
data_img = np.ma.masked_all((18, 16))
data_img[:16] = magnitude.reshape(16, 16)
scale_img = np.ma.masked_all((18, 16))
scale_img[16:] = scales_e4m3.reshape(2, 16)
ax.imshow(data_img, cmap="Blues", aspect="auto", vmin=0, vmax=12)
ax.imshow(scale_img, cmap="Oranges", aspect="auto", vmin=0, vmax=1.5 * scales_e4m3.max())
for i, byte in enumerate(nv):
    ax.text(i % 16, i // 16, f"{byte:02x}", ha="center", va="center", fontsize=7)
ax.axhline(15.5, color="k", lw=2)
ax.set_xticks(range(16), [f"+{i}" for i in range(16)], fontsize=7)
ax.set_yticks(
    range(18),
    [f"bytes {16 * r}–{16 * r + 15}: values {32 * r}–{32 * r + 31}" for r in range(16)]
    + ["bytes 256–271: scales g0–g15", "bytes 272–287: scales g16–g31"],
    fontsize=7,
)
ax.set_title("NVFP4 row (D=512, 288 B): 256 B of E2M1 nibble pairs + 32 B of E4M3 scales")
plt.show()

# %% [markdown]
# Decoding group 0 by hand: byte k holds values 2k (low nibble) and 2k+1 (high nibble); each
# nibble indexes the E2M1 table and is multiplied by the group's scale, byte 256 read as E4M3
# (here with `ml_dtypes`, independently of the library).

# %%
group0 = np.stack([lo_nibble[:8], hi_nibble[:8]], axis=-1).reshape(16)
decoded = table[group0] * scales_e4m3[0]
print(f"scale byte 256 = 0x{nv[256]:02x} -> E4M3 {scales_e4m3[0]:g}")
print("value  original  nibble  E2M1  x scale")
for i in range(16):
    print(
        f"{i:5d}  {float(row[i]):+8.4f}  {group0[i]:6d}  {table[group0[i]]:+4.1f}  "
        f"{decoded[i]:+8.4f}"
    )
assert np.array_equal(decoded, np.asarray(unpack(nv, "nvfp4"))[:16])

fig, ax = plt.subplots(figsize=(9, 3))
ax.bar(np.arange(16) - 0.2, np.asarray(row[:16]), 0.4, label="original", color="lightgray")
ax.bar(np.arange(16) + 0.2, decoded, 0.4, label="NVFP4 (decoded bytes)", color=COLORS["nvfp4"])
ax.set(xlabel="value index in group 0", title=f"group 0: scale {scales_e4m3[0]:g}")
ax.set_xticks(range(16))
ax.legend(fontsize=8)
ax.grid(axis="y", alpha=0.3)
plt.show()

# %% [markdown]
# The three layouts side by side, on one byte axis: each strip is the actual packed row
# (colour = byte value), with the element and scale regions marked.

# %%
fig, axes = plt.subplots(3, 1, figsize=(11, 4), sharex=True)
for ax, (f, d) in zip(axes, row_dims.items(), strict=True):
    b = packed[f]
    n_data = b.size - d // formats.FORMATS[f].group_size
    ax.imshow(b[None, :], cmap="viridis", aspect="auto", extent=(0, b.size, 0, 1))
    element_bits = 4 if formats.FORMATS[f].element == "e2m1" else 8
    for start, stop in ((0, n_data), (n_data, b.size)):
        ax.axvspan(start, stop, ymin=0, ymax=1 / 1.5, fill=False, ec="red", lw=1.5)
    ax.text(2, 1.2, f"{n_data} B elements ({element_bits}-bit)", fontsize=8)
    scale_name = formats.FORMATS[f].scale.upper()
    ax.text(b.size + 4, 0.5, f"{b.size - n_data} B {scale_name} scales", va="center", fontsize=8)
    ax.set_yticks([])
    ax.set_ylabel(f"{f}\nD={d}\n{b.size} B", rotation=0, ha="right", va="center", fontsize=8)
    ax.set_ylim(0, 1.5)
axes[-1].set_xlim(0, 1.2 * max(b.size for b in packed.values()))
axes[-1].set_xlabel("byte offset in the row")
fig.suptitle("Packed rows: NVFP4 main KV, MXFP4 index key, FP8 window KV")
fig.tight_layout()
plt.show()

# %% [markdown]
# ## 5. KV bytes per token
#
# `v41jax.accounting` turns the row sizes into the cache footprint. V4.1-Flash stores one main-KV
# row and one index-key row per compressed entry, at 4 KV source layers (three with compression
# ratio 2, the candidate source with ratio 1): 890 B per token of context.

# %%
print(tables.render_kv_sources("V4.1-Flash", config.v41_flash()))
print()
print(tables.render_storage_steps(accounting.storage_steps(), accounting.DEFAULT_CONTEXT))

# %% [markdown]
# The same V4.1-Flash layout with the other main-KV formats (the index keys stay MXFP4): FP4
# halves the main KV against FP8 and quarters it against BF16.

# %%
kv_formats = ("nvfp4", "mxfp4", "fp8", "bf16")
per_format = {}
for f in kv_formats:
    try:
        per_format[f] = accounting.kv_bytes_per_token(config.v41_flash().replace(kv_format=f))
    except ValueError as err:  # a layout the format cannot store
        print(f"{f}: {err}")
context = accounting.DEFAULT_CONTEXT
print(f"{'main KV':>8}  {'row B':>6}  {'main B/tok':>10}  {'index B/tok':>11}  {'total':>7}  at 1M")
for f, kv in per_format.items():
    row_b = kv.sources[0].main_row_bytes
    print(
        f"{f:>8}  {row_b:6d}  {float(kv.main_bytes):10.0f}  {float(kv.index_bytes):11.0f}  "
        f"{float(kv.total):7.0f}  {float(kv.bytes_at(context)) / accounting.GIB:.2f} GiB"
    )

fig, ax = plt.subplots(figsize=(7, 3.5))
names = list(per_format)
main_b = [float(per_format[f].main_bytes) for f in names]
index_b = [float(per_format[f].index_bytes) for f in names]
ax.bar(names, main_b, label="main KV", color=[COLORS[f] for f in names])
bars = ax.bar(names, index_b, bottom=main_b, label="indexer K (MXFP4)", color="lightgray")
ax.bar_label(bars, labels=[f"{m + i:.0f} B" for m, i in zip(main_b, index_b, strict=True)])
ax.set(ylabel="bytes per token", title="V4.1-Flash global KV per token by main-KV format")
ax.legend(fontsize=8)
ax.grid(axis="y", alpha=0.3)
plt.show()

# %% [markdown]
# The toy preset used for training in the other notebooks, for scale:

# %%
print(tables.render_kv_sources("tiny", config.tiny()))
