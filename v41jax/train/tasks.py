"""Synthetic long-range retrieval tasks for training and evaluating the candidate pool (DESIGN §7).

Three tasks, all generated in numpy, vectorized over the batch and deterministic from a seed:

  - 'mqar': scattered multi-query associative recall (Zoology's MQAR with the key-value pairs
    spread over the whole context among filler tokens).
  - 'passkey': a marker and an N-digit key at a random (or fixed) depth in filler, recalled digit
    by digit after a query marker at the end (the Landmark Attention / Quest recipe at toy scale).
  - 'multi_passkey': several one-digit passkeys, each with its own marker and digit range, all
    recalled after the query marker (one scored lookup per needle).

Each task is a frozen dataclass: its fields are the task's configuration (validated on
construction), its methods draw batches. Contexts default to 128 tokens, 4x the 32-position
candidate pool of `config.tiny()`, so the pool has to find the evidence rather than cover it.

Token ids (shared by both tasks so one model can be trained on a mix): 0 `PAD` (reserved, never
generated), 1 `BOS`, 2 `QUERY` (starts the query region), 3 `KEY_MARKER` (passkey: the key
follows); every other id belongs to one of the task's half-open ranges, which must not overlap
the specials or each other.

Sequences are built with one extra token and split into `tokens = seq[:, :-1]` and
`targets = seq[:, 1:]`, so the model at position t predicts `targets[t]`, and only the answers are
scored (`loss_mask`). `evidence[b, t]` is the position in `tokens` the answer at t must be
retrieved from (-1 where not scored); `t - evidence` is the retrieval distance to bucket by.

Example:
    >>> task = make_task("mqar", seq_len=1024)
    >>> batch = task.batch_at(seed=0, step=7, batch_size=64)  # the same batch after a resume
    >>> batch.tokens.shape, int(batch.loss_mask.sum(1)[0])
    ((64, 1024), 8)
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import ClassVar, NamedTuple

import numpy as np

PAD, BOS, QUERY, KEY_MARKER = 0, 1, 2, 3
N_SPECIAL = 4
SPECIAL_NAMES = {PAD: "<pad>", BOS: "<bos>", QUERY: "<q>", KEY_MARKER: "<key>"}


class Batch(NamedTuple):
    """One batch of a retrieval task; numpy arrays (move them to the device with `jnp.asarray`).

    Attributes:
      tokens: int32 [batch, seq_len], the model input.
      targets: int32 [batch, seq_len], next-token targets: `targets[:, t] == tokens[:, t + 1]`.
      loss_mask: bool [batch, seq_len], True only at the scored (answer) positions.
      evidence: int32 [batch, seq_len], for each scored position the position in `tokens` holding
        the token to retrieve (`tokens[b, evidence[b, t]] == targets[b, t]`); -1 elsewhere.
    """

    tokens: np.ndarray
    targets: np.ndarray
    loss_mask: np.ndarray
    evidence: np.ndarray

    @property
    def distance(self) -> np.ndarray:
        """int32 [batch, seq_len]: `t - evidence` at scored positions, -1 elsewhere."""
        t = np.arange(self.tokens.shape[1], dtype=np.int32)
        return np.where(self.loss_mask, t - self.evidence, -1).astype(np.int32)


def _sample_without_replacement(rng: np.random.Generator, batch: int, n: int, k: int) -> np.ndarray:
    """int64 [batch, k]: per row, k distinct ints from [0, n) in uniformly random order."""
    return np.argsort(rng.random((batch, n)), axis=1)[:, :k]


def _sample_subset_sorted(rng: np.random.Generator, batch: int, n: int, k: int) -> np.ndarray:
    """int64 [batch, k]: per row, a uniform k-subset of [0, n), ascending."""
    # argpartition picks the k smallest of iid uniforms (a uniform subset) in O(n), not O(n log n).
    return np.sort(np.argpartition(rng.random((batch, n)), k - 1, axis=1)[:, :k], axis=1)


def _scattered_pair_starts(rng: np.random.Generator, batch: int, n_ctx: int, d: int) -> np.ndarray:
    """int64 [batch, d]: ascending starts of d non-overlapping 2-token pairs in [0, n_ctx),
    uniform over all such placements (stars and bars: d sorted distinct slots in
    [0, n_ctx - d), each shifted by its rank)."""
    return _sample_subset_sorted(rng, batch, n_ctx - d, d) + np.arange(d)


def _write_query_region(
    seq: np.ndarray, query_start: int, keys: np.ndarray, values: np.ndarray
) -> np.ndarray:
    """Writes <q> at `query_start`, then "key value" pairs [B, Q]; returns the Q scored
    positions (each key, whose target is its value)."""
    seq[:, query_start] = QUERY
    scored = query_start + 1 + 2 * np.arange(keys.shape[1])
    seq[:, scored] = keys
    seq[:, scored + 1] = values
    return scored


def _is_int(value) -> bool:
    return isinstance(value, int | np.integer) and not isinstance(value, bool)


class RetrievalTask:
    """Batch drawing shared by the tasks; subclasses are frozen dataclasses that implement
    `_fill(rng, seq) -> (scored, evidence)` and list their id-range fields in `_prefixes`."""

    name: ClassVar[str]
    _prefixes: ClassVar[dict[str, str]]  # id-range field -> prefix of its ids in `token_name`
    seq_len: int
    filler_ids: tuple[int, int]
    vocab_size: int

    def _fail(self, field: str, expected: str, got) -> None:
        raise ValueError(f"{type(self).__name__}.{field}: expected {expected}, got {got!r}")

    def _ranges(self) -> dict[str, tuple[int, int]]:
        return {field: getattr(self, field) for field in self._prefixes}

    def _fill(self, rng: np.random.Generator, seq: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        raise NotImplementedError

    def _validate_common(self, min_seq_len: int, why: str) -> None:
        if not _is_int(self.vocab_size) or self.vocab_size <= N_SPECIAL:
            self._fail("vocab_size", f"an int > {N_SPECIAL} (the special tokens)", self.vocab_size)
        if not _is_int(self.seq_len) or self.seq_len < min_seq_len:
            self._fail("seq_len", f"an int >= {min_seq_len} ({why})", self.seq_len)
        for field in self._prefixes:  # a range read from JSON or a CLI arrives as a list
            if isinstance(getattr(self, field), list):
                object.__setattr__(self, field, tuple(getattr(self, field)))
        ranges = self._ranges()
        for field, r in ranges.items():
            if (
                not isinstance(r, tuple)
                or len(r) != 2
                or not all(_is_int(x) for x in r)
                or not N_SPECIAL <= r[0] < r[1] <= self.vocab_size
            ):
                self._fail(
                    field,
                    f"a (start, stop) id range with {N_SPECIAL} <= start < stop <= "
                    f"vocab_size={self.vocab_size} (ids below {N_SPECIAL} are special tokens)",
                    r,
                )
        items = sorted(ranges.items(), key=lambda kv: kv[1])
        for (f0, r0), (f1, r1) in itertools.pairwise(items):
            if r1[0] < r0[1]:
                self._fail(f1, f"an id range disjoint from {f0}={r0}", r1)

    def replace(self, **changes) -> RetrievalTask:
        """A copy with `changes` applied (validated again)."""
        return dataclasses.replace(self, **changes)

    @property
    def scored_per_example(self) -> int:
        """Scored positions in every example (loss_mask.sum(1) is this constant)."""
        raise NotImplementedError

    def batch(self, rng_or_seed: np.random.Generator | int, batch_size: int) -> Batch:
        """Draws `batch_size` independent examples from `rng_or_seed` (a Generator or an int)."""
        if not _is_int(batch_size) or batch_size <= 0:
            raise ValueError(f"batch: batch_size: expected a positive int, got {batch_size!r}")
        if isinstance(rng_or_seed, np.random.Generator):
            rng = rng_or_seed
        elif _is_int(rng_or_seed) and rng_or_seed >= 0:
            rng = np.random.default_rng(rng_or_seed)
        else:
            raise ValueError(
                "batch: rng_or_seed: expected a numpy Generator or a non-negative int, "
                f"got {rng_or_seed!r}"
            )
        seq = np.empty((batch_size, self.seq_len + 1), np.int32)
        seq[:, 0] = BOS
        scored, evidence = self._fill(rng, seq)
        loss_mask = np.zeros((batch_size, self.seq_len), bool)
        loss_mask[:, scored] = True
        full_evidence = np.full((batch_size, self.seq_len), -1, np.int32)
        full_evidence[:, scored] = evidence
        return Batch(seq[:, :-1], seq[:, 1:], loss_mask, full_evidence)

    def batch_at(self, seed: int, step: int, batch_size: int) -> Batch:
        """The batch of training step `step` of run `seed`.

        It depends only on (task, seed, step, batch_size), so a run resumed at step k sees the same
        batches as one that never stopped. Use a seed no training run uses for held-out data.
        """
        for arg, value in (("seed", seed), ("step", step)):
            if not _is_int(value) or value < 0:
                raise ValueError(f"batch_at: {arg}: expected a non-negative int, got {value!r}")
        return self.batch(np.random.default_rng([seed, step]), batch_size)

    def token_name(self, token: int) -> str:
        """A short readable name: specials as `<bos>` etc., range ids as a prefix and an offset."""
        if token in SPECIAL_NAMES:
            return SPECIAL_NAMES[token]
        for field, (lo, hi) in self._ranges().items():
            if lo <= token < hi:
                return f"{self._prefixes[field]}{token - lo}"
        return f"?{token}"

    def format_example(self, batch: Batch, i: int = 0) -> str:
        """Renders example `i` of `batch` on one line for notebooks.

        Runs of filler collapse to `…×n`; a scored position reads `tok→target@distance`, the
        token the model sees, the target it must predict and how far back the evidence is.
        """
        tokens, targets = batch.tokens[i], batch.targets[i]
        mask, dist = batch.loss_mask[i], batch.distance[i]
        filler_lo, filler_hi = self.filler_ids
        parts, run = [], 0
        for t, tok in enumerate(tokens.tolist()):
            if filler_lo <= tok < filler_hi and not mask[t]:
                run += 1
                continue
            if run:
                parts.append(f"…×{run}")
                run = 0
            name = self.token_name(tok)
            if mask[t]:
                name += f"→{self.token_name(int(targets[t]))}@{int(dist[t])}"
            parts.append(name)
        if run:
            parts.append(f"…×{run}")
        return " ".join(parts)


@dataclasses.dataclass(frozen=True)
class MQARTask(RetrievalTask):
    """Scattered multi-query associative recall ('mqar').

    Layout (one example, positions in `tokens`):
        <bos> [context: n_pairs "k v" pairs among filler] <q> k_a v_a k_b v_b ... (n_queries pairs)
    Keys and values are drawn without replacement per example (no key or value repeats), the
    queried keys are a random subset of the pairs in random order. Scored: the position of each
    queried key in the query region, target its value; evidence: the position of that value in
    the context (the key sits just before it). Each answer is shown right after it is scored (as
    in generation), so later queries can rule out values already answered: keep n_queries well
    below n_pairs or the last queries become guessable by elimination.

    Why scattered: Zoology's stock MQAR puts all pairs in the first 2D tokens, which a candidate
    pool of >= 2D positions covers trivially (`experiments_anchors.md` §1 caveat). Scattered
    pairs are uniform over all non-overlapping placements in the context, so most evidence is
    farther than the window and the pool must pick the right blocks. `arrangement='stock'` keeps
    the pairs at the start (a sanity check: the pool covers them, sparse == dense).

    Args:
      seq_len: tokens per example (model input length). Default 128 = 4x the tiny pool.
      n_pairs: key-value pairs D in the context.
      n_queries: queried keys Q (<= n_pairs), each scored once.
      arrangement: 'scattered' (pairs at uniform random non-overlapping positions) or 'stock'
        (pairs back to back right after <bos>).
      key_ids: half-open id range of keys.
      value_ids: half-open id range of values.
      filler_ids: half-open id range of filler tokens (uniform random).
      vocab_size: every id must be below it (the model's embedding rows).
    """

    name: ClassVar[str] = "mqar"
    _prefixes: ClassVar[dict[str, str]] = {
        "key_ids": "k",
        "value_ids": "v",
        "filler_ids": "f",
    }

    seq_len: int = 128
    n_pairs: int = 16
    n_queries: int = 8
    arrangement: str = "scattered"
    key_ids: tuple[int, int] = (4, 68)
    value_ids: tuple[int, int] = (68, 132)
    filler_ids: tuple[int, int] = (132, 256)
    vocab_size: int = 256

    ARRANGEMENTS: ClassVar[tuple[str, ...]] = ("scattered", "stock")

    def __post_init__(self):
        for field in ("n_pairs", "n_queries"):
            value = getattr(self, field)
            if not _is_int(value) or value <= 0:
                self._fail(field, "a positive int", value)
        if self.n_queries > self.n_pairs:
            self._fail("n_queries", f"<= n_pairs={self.n_pairs} (distinct keys)", self.n_queries)
        if self.arrangement not in self.ARRANGEMENTS:
            self._fail("arrangement", f"one of {self.ARRANGEMENTS}", self.arrangement)
        min_len = 2 * self.n_pairs + 2 * self.n_queries + 1
        self._validate_common(
            min_len,
            f"<bos>, 2*n_pairs={2 * self.n_pairs} context tokens, <q> and "
            f"2*n_queries={2 * self.n_queries} query tokens, less the last target",
        )
        for field in ("key_ids", "value_ids"):
            lo, hi = getattr(self, field)
            if hi - lo < self.n_pairs:
                self._fail(
                    field,
                    f"a range of at least n_pairs={self.n_pairs} ids (drawn without replacement)",
                    (lo, hi),
                )

    @property
    def context_len(self) -> int:
        """Context tokens between <bos> and <q>: seq_len - 1 - 2 * n_queries."""
        return self.seq_len - 1 - 2 * self.n_queries

    @property
    def scored_per_example(self) -> int:
        return self.n_queries

    def _fill(self, rng, seq):
        b, n_ctx, d, q = seq.shape[0], self.context_len, self.n_pairs, self.n_queries
        rows = np.arange(b)[:, None]
        seq[:, 1 : 1 + n_ctx] = rng.integers(*self.filler_ids, size=(b, n_ctx), dtype=np.int32)
        (k_lo, k_hi), (v_lo, v_hi) = self.key_ids, self.value_ids
        keys = k_lo + _sample_without_replacement(rng, b, k_hi - k_lo, d)
        values = v_lo + _sample_without_replacement(rng, b, v_hi - v_lo, d)
        if self.arrangement == "scattered":
            starts = _scattered_pair_starts(rng, b, n_ctx, d)
        else:
            starts = np.broadcast_to(2 * np.arange(d), (b, d))
        key_pos = 1 + starts
        seq[rows, key_pos] = keys
        seq[rows, key_pos + 1] = values
        asked = _sample_without_replacement(rng, b, d, q)
        scored = _write_query_region(
            seq,
            1 + n_ctx,
            np.take_along_axis(keys, asked, axis=1),
            np.take_along_axis(values, asked, axis=1),
        )
        return scored, np.take_along_axis(key_pos + 1, asked, axis=1)

    def describe(self) -> str:
        """A few lines on the layout, scoring and chance level."""
        n_keys = self.key_ids[1] - self.key_ids[0]
        n_values = self.value_ids[1] - self.value_ids[0]
        return (
            f"mqar ({self.arrangement}): seq_len {self.seq_len}; {self.n_pairs} key-value pairs "
            f"in a {self.context_len}-token context (keys from {n_keys} ids, values from "
            f"{n_values}, filler from {self.filler_ids[1] - self.filler_ids[0]}), then <q> and "
            f"{self.n_queries} queried keys each followed by its value.\n"
            f"Scored: {self.n_queries} positions per example (each queried key; target its "
            f"value). Chance: 1/{n_values} uniform; 1/{self.n_pairs} guessing among the "
            f"context's values, up to 1/{self.n_pairs - self.n_queries + 1} at the last query "
            "by ruling out the values already answered."
        )


@dataclasses.dataclass(frozen=True)
class PasskeyTask(RetrievalTask):
    """Passkey retrieval ('passkey').

    Layout (one example, positions in `tokens`):
        <bos> [filler ... <key> d_0 ... d_{N-1} ... filler] <q> d_0 ... d_{N-1}
    The needle (`<key>` and N uniform random digits) starts at a uniform random position of the
    context, or at `depth` (a fraction: 0 right after <bos>, 1 ending right before <q>). Scored:
    <q> (target d_0) and the recalled digits d_0..d_{N-2} (targets d_1..d_{N-1}); evidence of the
    target d_i: the position of d_i in the needle. Exact match of the key = all N scored positions
    right (teacher forced).

    Args:
      seq_len: tokens per example. Default 128 = 4x the tiny pool; test lengths up to 4x the
        training length for extrapolation (the Landmark / Quest protocol).
      n_digits: digits N of the key. Default 1, the single-needle passkey: recalling it is one
        content lookup that tiny() learns within `v41jax train`'s CPU budget. Recalling digits
        after the first is an induction step (find d_{i-1} in the needle, copy its successor)
        that small models learn only after a long plateau; n_digits=5 is Landmark's key.
      depth: None (uniform over every position the needle fits) or a fixed fraction in [0, 1] for
        length x depth grids.
      filler: 'random' (uniform ids from filler_ids) or 'pattern' (filler_ids cycled in order
        from <bos> on, like Landmark's repeated sentences; the needle is then the only break).
      digit_ids: half-open id range of digits (10 ids for decimal keys).
      filler_ids: half-open id range of filler tokens.
      vocab_size: every id must be below it.
    """

    name: ClassVar[str] = "passkey"
    _prefixes: ClassVar[dict[str, str]] = {"digit_ids": "", "filler_ids": "f"}

    seq_len: int = 128
    n_digits: int = 1
    depth: float | None = None
    filler: str = "random"
    digit_ids: tuple[int, int] = (4, 14)
    filler_ids: tuple[int, int] = (132, 256)
    vocab_size: int = 256

    FILLERS: ClassVar[tuple[str, ...]] = ("random", "pattern")

    def __post_init__(self):
        if not _is_int(self.n_digits) or self.n_digits <= 0:
            self._fail("n_digits", "a positive int", self.n_digits)
        if self.depth is not None and (
            isinstance(self.depth, bool)
            or not isinstance(self.depth, int | float | np.floating)
            or not 0.0 <= self.depth <= 1.0
        ):
            self._fail("depth", "None (uniform) or a fraction in [0, 1]", self.depth)
        if self.filler not in self.FILLERS:
            self._fail("filler", f"one of {self.FILLERS}", self.filler)
        self._validate_common(
            2 * self.n_digits + 2,
            f"<bos>, <key> and n_digits={self.n_digits} digits, <q> and the digits again, less "
            "the last target",
        )

    @property
    def context_len(self) -> int:
        """Context tokens between <bos> and <q> (needle included): seq_len - 1 - n_digits."""
        return self.seq_len - 1 - self.n_digits

    @property
    def scored_per_example(self) -> int:
        return self.n_digits

    def needle_start(self, depth: float) -> int:
        """Position in `tokens` of <key> for a fixed `depth` (the rounding the batches use)."""
        return 1 + round(depth * (self.context_len - self.n_digits - 1))

    def _fill(self, rng, seq):
        b, n_ctx, n = seq.shape[0], self.context_len, self.n_digits
        rows = np.arange(b)[:, None]
        lo, hi = self.filler_ids
        if self.filler == "random":
            seq[:, 1 : 1 + n_ctx] = rng.integers(lo, hi, size=(b, n_ctx), dtype=np.int32)
        else:
            seq[:, 1 : 1 + n_ctx] = lo + np.arange(n_ctx) % (hi - lo)
        if self.depth is None:
            marker = 1 + rng.integers(0, n_ctx - n, size=(b, 1))
        else:
            marker = np.full((b, 1), self.needle_start(self.depth))
        digits = rng.integers(*self.digit_ids, size=(b, n), dtype=np.int32)
        seq[rows, marker] = KEY_MARKER
        seq[rows, marker + 1 + np.arange(n)] = digits
        query = 1 + n_ctx
        seq[:, query] = QUERY
        seq[:, query + 1 :] = digits
        return query + np.arange(n), marker + 1 + np.arange(n)

    def describe(self) -> str:
        """A few lines on the layout, scoring and chance level."""
        where = "uniform depth" if self.depth is None else f"depth {self.depth:g}"
        n_digit_ids = self.digit_ids[1] - self.digit_ids[0]
        return (
            f"passkey: seq_len {self.seq_len}; <key> and a {self.n_digits}-digit key at {where} in "
            f"a {self.context_len}-token {self.filler} filler context, then <q> and the key again."
            f"\nScored: {self.n_digits} positions per example (<q> and each recalled digit but "
            f"the last; targets the key's digits). Chance: 1/{n_digit_ids} per digit."
        )


@dataclasses.dataclass(frozen=True)
class MultiPasskeyTask(RetrievalTask):
    """Several passkeys in one context, each recalled by its marker ('multi_passkey').

    Layout (one example, positions in `tokens`):
        <bos> [filler with n_needles needles "m_i d_i"] <q> m_a d_a m_b d_b ... (all needles)
    Needle i is its marker m_i (one id of `marker_ids` per needle, the same every example)
    followed by a digit d_i drawn from the marker's own range of `digits_per_needle` ids. The
    needles sit at uniform random non-overlapping positions of the context; after <q> every
    marker comes once, in random order, followed by its digit. Scored: each marker of the query
    region, target its digit; evidence: the position of that digit in the context.

    Why: the single passkey scores one position per sequence, and a tiny model's plateau before
    it finds the needle varies from seed to seed. Here every sequence scores `n_needles`
    independent lookups of the same kind (one content lookup each: "the digit of range i"), so
    a step carries n_needles times the supervision at the same cost. Digit ranges are disjoint,
    so an answered needle tells nothing about the others (no guessing by elimination), and each
    query needs its own blocks in the pool.

    Args:
      seq_len: tokens per example. Default 128 = 4x the tiny pool.
      n_needles: needles (and scored positions) per example.
      digits_per_needle: size of each needle's digit range (chance is 1/digits_per_needle).
      marker_ids: half-open id range of the markers (n_needles ids).
      digit_ids: half-open id range of the digits (n_needles * digits_per_needle ids).
      filler_ids: half-open id range of filler tokens (uniform random).
      vocab_size: every id must be below it.
    """

    name: ClassVar[str] = "multi_passkey"
    _prefixes: ClassVar[dict[str, str]] = {
        "marker_ids": "m",
        "digit_ids": "d",
        "filler_ids": "f",
    }

    seq_len: int = 128
    n_needles: int = 8
    digits_per_needle: int = 8
    marker_ids: tuple[int, int] = (4, 12)
    digit_ids: tuple[int, int] = (12, 76)
    filler_ids: tuple[int, int] = (132, 256)
    vocab_size: int = 256

    def __post_init__(self):
        for field in ("n_needles", "digits_per_needle"):
            value = getattr(self, field)
            if not _is_int(value) or value <= 0:
                self._fail(field, "a positive int", value)
        self._validate_common(
            4 * self.n_needles + 1,
            f"<bos>, 2*n_needles={2 * self.n_needles} needle tokens, <q> and "
            f"2*n_needles={2 * self.n_needles} query tokens, less the last target",
        )
        for field, want in (
            ("marker_ids", self.n_needles),
            ("digit_ids", self.n_needles * self.digits_per_needle),
        ):
            lo, hi = getattr(self, field)
            if hi - lo != want:
                self._fail(field, f"a range of exactly {want} ids", (lo, hi))

    @property
    def context_len(self) -> int:
        """Context tokens between <bos> and <q>: seq_len - 1 - 2 * n_needles."""
        return self.seq_len - 1 - 2 * self.n_needles

    @property
    def scored_per_example(self) -> int:
        return self.n_needles

    def _fill(self, rng, seq):
        b, n_ctx, m = seq.shape[0], self.context_len, self.n_needles
        rows = np.arange(b)[:, None]
        seq[:, 1 : 1 + n_ctx] = rng.integers(*self.filler_ids, size=(b, n_ctx), dtype=np.int32)
        markers = self.marker_ids[0] + np.arange(m)
        digits = (
            self.digit_ids[0]
            + np.arange(m) * self.digits_per_needle
            + rng.integers(0, self.digits_per_needle, size=(b, m))
        ).astype(np.int32)
        starts = _scattered_pair_starts(rng, b, n_ctx, m)
        order = _sample_without_replacement(rng, b, m, m)  # needle i sits at the order[i]-th slot
        marker_pos = 1 + np.take_along_axis(starts, order, axis=1)
        seq[rows, marker_pos] = markers
        seq[rows, marker_pos + 1] = digits
        asked = _sample_without_replacement(rng, b, m, m)
        scored = _write_query_region(
            seq, 1 + n_ctx, markers[asked], np.take_along_axis(digits, asked, axis=1)
        )
        return scored, np.take_along_axis(marker_pos + 1, asked, axis=1)

    def describe(self) -> str:
        """A few lines on the layout, scoring and chance level."""
        return (
            f"multi_passkey: seq_len {self.seq_len}; {self.n_needles} needles (a marker and a "
            f"digit from the marker's own {self.digits_per_needle} ids) in a "
            f"{self.context_len}-token random filler context, then <q> and every marker again, "
            "each followed by its digit.\n"
            f"Scored: {self.n_needles} positions per example (each marker after <q>; target its "
            f"digit). Chance: 1/{self.digits_per_needle}."
        )


TASKS: dict[str, type[RetrievalTask]] = {
    "mqar": MQARTask,
    "passkey": PasskeyTask,
    "multi_passkey": MultiPasskeyTask,
}


def make_task(name: str, **overrides) -> RetrievalTask:
    """The task `name` from `TASKS` with its defaults and `overrides` (field=value) applied."""
    if name not in TASKS:
        raise ValueError(f"make_task: name: expected one of {sorted(TASKS)}, got {name!r}")
    fields = {f.name for f in dataclasses.fields(TASKS[name])}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise ValueError(
            f"make_task: overrides: expected fields of {TASKS[name].__name__} "
            f"({sorted(fields)}), got unknown {unknown}"
        )
    return TASKS[name](**overrides)
