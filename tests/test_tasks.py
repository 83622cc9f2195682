"""`v41jax.train.tasks`: every answer recomputed from the tokens by a plain loop (DESIGN §7)."""

import dataclasses
import doctest

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from v41jax.nn.config import tiny
from v41jax.train import tasks
from v41jax.train.tasks import BOS, KEY_MARKER, PAD, QUERY, TASKS, Batch, make_task

SETTINGS = settings(deadline=None, max_examples=30)
POOL = tiny().candidate_pool_size


def check_batch(task, batch: Batch, batch_size: int):
    """Shapes, dtypes, next-token alignment, vocab and the evidence contract of any task."""
    shape = (batch_size, task.seq_len)
    for name, dtype in (("tokens", np.int32), ("targets", np.int32), ("evidence", np.int32)):
        assert getattr(batch, name).shape == shape and getattr(batch, name).dtype == dtype, name
    assert batch.loss_mask.shape == shape and batch.loss_mask.dtype == bool
    np.testing.assert_array_equal(batch.targets[:, :-1], batch.tokens[:, 1:])
    assert (batch.tokens[:, 0] == BOS).all()
    for arr in (batch.tokens, batch.targets):
        assert arr.min() > PAD and arr.max() < task.vocab_size
    np.testing.assert_array_equal(batch.loss_mask.sum(1), task.scored_per_example)
    assert ((batch.evidence >= 0) == batch.loss_mask).all()
    b, t = np.nonzero(batch.loss_mask)
    ev = batch.evidence[b, t]
    assert (ev < t).all()
    np.testing.assert_array_equal(batch.tokens[b, ev], batch.targets[b, t])
    np.testing.assert_array_equal(batch.distance[b, t], t - ev)
    assert (batch.distance[~batch.loss_mask] == -1).all()


def in_range(x, ids):
    return (ids[0] <= x) & (x < ids[1])


def check_mqar_example(task, tokens, targets, loss_mask, evidence):
    """Recomputes the key->value store from the context and checks every scored answer."""
    (q_pos,) = np.nonzero(tokens == QUERY)
    assert q_pos.tolist() == [task.context_len + 1]
    context = tokens[1 : q_pos[0]].tolist()
    store, key_positions = {}, []
    for i, tok in enumerate(context):
        if in_range(tok, task.key_ids):
            assert tok not in store, "keys are drawn without replacement"
            assert in_range(context[i + 1], task.value_ids), "a key is followed by its value"
            store[tok] = context[i + 1]
            key_positions.append(1 + i)
        elif in_range(tok, task.value_ids):
            assert in_range(context[i - 1], task.key_ids), "a value is preceded by its key"
        else:
            assert in_range(tok, task.filler_ids)
    assert len(store) == task.n_pairs
    assert len(set(store.values())) == task.n_pairs, "values are drawn without replacement"
    query = [*tokens[q_pos[0] + 1 :].tolist(), int(targets[-1])]
    asked = query[0::2]
    assert len(asked) == task.n_queries == len(set(asked))
    assert query[1::2] == [store[k] for k in asked]
    (scored,) = np.nonzero(loss_mask)
    assert scored.tolist() == list(range(q_pos[0] + 1, task.seq_len, 2))
    for t in scored:
        key = int(tokens[t])
        assert targets[t] == store[key]
        assert tokens[evidence[t] - 1] == key and evidence[t] - 1 in key_positions
    return key_positions


@pytest.mark.parametrize("name", sorted(TASKS))
def test_batch_at_is_deterministic_and_steps_differ(name):
    task = make_task(name)
    a, b = task.batch_at(3, 5, 8), task.batch_at(3, 5, 8)
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x, y)
    for other in (task.batch_at(3, 6, 8), task.batch_at(4, 5, 8)):
        assert not np.array_equal(a.tokens, other.tokens)
    np.testing.assert_array_equal(task.batch(11, 4).tokens, task.batch(11, 4).tokens)
    np.testing.assert_array_equal(
        task.batch(np.random.default_rng(11), 4).tokens, task.batch(11, 4).tokens
    )
    assert len({a.tokens[i].tobytes() for i in range(8)}) == 8, "examples of a batch differ"


@pytest.mark.parametrize("arrangement", ["scattered", "stock"])
def test_mqar_answers_recomputed(arrangement):
    task = make_task("mqar", arrangement=arrangement)
    batch = task.batch_at(0, 0, 32)
    check_batch(task, batch, 32)
    for i in range(32):
        key_positions = check_mqar_example(task, *(x[i] for x in batch))
        if arrangement == "stock":
            assert key_positions == list(range(1, 2 * task.n_pairs, 2))


def test_mqar_pairs_are_scattered_beyond_the_pool():
    task = make_task("mqar")
    assert task.seq_len >= 4 * POOL
    batch = task.batch_at(1, 0, 256)
    dist = batch.distance[batch.loss_mask]
    assert np.median(dist) > POOL
    assert (dist > task.seq_len // 2).mean() > 0.2, "far evidence is common"
    key_pos = np.nonzero(np.isin(batch.tokens, np.arange(*task.key_ids)))[1]
    ctx = key_pos[key_pos <= task.context_len]
    assert ctx.min() == 1 and ctx.max() == task.context_len - 1, "pairs reach both context ends"
    hist = np.histogram(ctx, bins=4, range=(1, task.context_len + 1))[0]
    assert hist.min() > 0.8 * hist.mean(), f"pairs uniform over the context: {hist}"


@SETTINGS
@given(
    n_pairs=st.integers(1, 20),
    n_queries=st.integers(1, 20),
    slack=st.integers(0, 40),
    arrangement=st.sampled_from(["scattered", "stock"]),
    seed=st.integers(0, 2**32 - 1),
)
def test_mqar_any_valid_config(n_pairs, n_queries, slack, arrangement, seed):
    n_queries = min(n_queries, n_pairs)
    task = make_task(
        "mqar",
        n_pairs=n_pairs,
        n_queries=n_queries,
        seq_len=2 * n_pairs + 2 * n_queries + 1 + slack,
        arrangement=arrangement,
        key_ids=(10, 10 + n_pairs),  # every key and value id used: tight ranges
        value_ids=(40, 40 + n_pairs),
        filler_ids=(70, 72),
        vocab_size=72,
    )
    batch = task.batch(seed, 3)
    check_batch(task, batch, 3)
    for i in range(3):
        check_mqar_example(task, *(x[i] for x in batch))


def check_passkey_example(task, tokens, targets, loss_mask, evidence):
    """Finds the needle by its marker and checks the recalled digits; returns <key>'s position."""
    (marker,) = np.nonzero(tokens == KEY_MARKER)
    (q_pos,) = np.nonzero(tokens == QUERY)
    n = task.n_digits
    assert len(marker) == 1 and q_pos.tolist() == [task.seq_len - n]
    key = tokens[marker[0] + 1 : marker[0] + 1 + n]
    assert in_range(key, task.digit_ids).all() and marker[0] + n < q_pos[0]
    filler = np.delete(tokens[1 : q_pos[0]], np.arange(marker[0], marker[0] + n + 1) - 1)
    assert in_range(filler, task.filler_ids).all()
    (scored,) = np.nonzero(loss_mask)
    assert scored.tolist() == list(range(q_pos[0], task.seq_len))
    np.testing.assert_array_equal(targets[scored], key)
    np.testing.assert_array_equal(tokens[scored[1:]], key[:-1])
    np.testing.assert_array_equal(evidence[scored], marker[0] + 1 + np.arange(n))
    return int(marker[0])


@pytest.mark.parametrize("filler", ["random", "pattern"])
@pytest.mark.parametrize("depth", [None, 0.0, 0.9, 1.0])
def test_passkey_answers_and_depth(depth, filler):
    task = make_task("passkey", depth=depth, filler=filler)
    batch = task.batch_at(0, 0, 64)
    check_batch(task, batch, 64)
    markers = [check_passkey_example(task, *(x[i] for x in batch)) for i in range(64)]
    last = task.context_len - task.n_digits  # <key> position of a needle ending right before <q>
    if depth is None:
        assert min(markers) < POOL and max(markers) > task.seq_len - POOL
        assert len(set(markers)) > 32
    else:
        expected = 1 + round(depth * (last - 1))
        assert markers == [expected] * 64 == [task.needle_start(depth)] * 64
    assert {0.0: 1, 1.0: last}.get(depth, markers[0]) == markers[0]
    digits = batch.targets[batch.loss_mask]
    assert len(np.unique(digits)) == 10, "keys use every digit"


def test_passkey_uniform_depth_reaches_every_position():
    task = make_task("passkey", seq_len=16)  # context of 10: the 6-token needle fits at 5 places
    batch = task.batch(0, 200)
    markers = {check_passkey_example(task, *(x[i] for x in batch)) for i in range(200)}
    assert markers == set(range(1, task.context_len - task.n_digits + 1))


def test_passkey_pattern_filler_repeats():
    task = make_task("passkey", filler="pattern", depth=1.0, filler_ids=(100, 108))
    tokens = task.batch(0, 2).tokens
    np.testing.assert_array_equal(tokens[0, 1:100], 100 + np.arange(99) % 8)
    np.testing.assert_array_equal(tokens[0, 1:100], tokens[1, 1:100])


@pytest.mark.parametrize("seed", range(3))
def test_multi_passkey_every_marker_recalls_its_own_digit(seed):
    task = make_task("multi_passkey")
    batch = task.batch_at(seed, 0, 16)
    check_batch(task, batch, 16)
    m, n = task.n_needles, task.digits_per_needle
    for tokens, targets, mask, evidence in zip(*batch[:4], strict=True):
        (scored,) = np.nonzero(mask)
        asked = tokens[scored] - task.marker_ids[0]
        assert sorted(asked.tolist()) == list(range(m)), "every marker asked once"
        digit_offset = targets[scored] - task.digit_ids[0]
        np.testing.assert_array_equal(digit_offset // n, asked)  # the marker's own range
        np.testing.assert_array_equal(tokens[evidence[scored] - 1], tokens[scored])
        context = tokens[1 : task.context_len + 1]
        assert in_range(context, task.marker_ids).sum() == m  # one needle per marker
        assert (evidence[scored] < task.context_len + 1).all()


@pytest.mark.parametrize("name", sorted(TASKS))
def test_long_batches_are_vectorized(name):
    # Functional only (no wall-clock assert): 64 x 1024 is what a training step consumes.
    task = make_task(name, seq_len=1024)
    batch = task.batch_at(0, 0, 64)
    check_batch(task, batch, 64)


BAD_ARGS = [
    ("mqar", {"seq_len": 40}, "seq_len"),  # 16 pairs + 8 queries need 49
    ("mqar", {"seq_len": 256.0}, "seq_len"),
    ("mqar", {"n_pairs": 0}, "n_pairs"),
    ("mqar", {"n_queries": 17}, "n_queries"),
    ("mqar", {"n_queries": True}, "n_queries"),
    ("mqar", {"arrangement": "front"}, "arrangement"),
    ("mqar", {"key_ids": (60, 100)}, "value_ids"),  # overlaps value ids
    ("mqar", {"key_ids": (4, 10)}, "key_ids"),  # fewer ids than pairs
    ("mqar", {"key_ids": (2, 68)}, "key_ids"),  # takes special ids
    ("mqar", {"filler_ids": (132, 300)}, "filler_ids"),  # beyond vocab_size
    ("mqar", {"filler_ids": (132,)}, "filler_ids"),
    ("mqar", {"vocab_size": 200}, "filler_ids"),
    ("mqar", {"vocab_size": 3}, "vocab_size"),
    ("passkey", {"seq_len": 3}, "seq_len"),
    ("passkey", {"n_digits": 0}, "n_digits"),
    ("passkey", {"depth": 1.5}, "depth"),
    ("passkey", {"depth": "deep"}, "depth"),
    ("passkey", {"filler": "zeros"}, "filler"),
    ("passkey", {"digit_ids": (130, 140)}, "filler_ids"),
    ("multi_passkey", {"n_needles": 0}, "n_needles"),
    ("multi_passkey", {"digits_per_needle": 9}, "digit_ids"),  # 8 needles x 9 ids != 64 ids
    ("multi_passkey", {"n_needles": 4}, "marker_ids"),  # 8 marker ids for 4 needles
    ("multi_passkey", {"seq_len": 32}, "seq_len"),  # 8 needles need 33
]


@pytest.mark.parametrize(("name", "overrides", "arg"), BAD_ARGS)
def test_bad_arguments_name_the_argument(name, overrides, arg):
    with pytest.raises(ValueError, match=rf"\.{arg}: expected"):
        make_task(name, **overrides)


def test_bad_calls_name_the_argument():
    task = make_task("mqar")
    with pytest.raises(ValueError, match="name: expected one of"):
        make_task("copying")
    with pytest.raises(ValueError, match=r"unknown.*n_keys"):
        make_task("mqar", n_keys=3)
    with pytest.raises(ValueError, match="batch_size"):
        task.batch(0, 0)
    with pytest.raises(ValueError, match="rng_or_seed"):
        task.batch(-1, 2)
    with pytest.raises(ValueError, match="step"):
        task.batch_at(0, -1, 2)
    with pytest.raises(ValueError, match="seed"):
        task.batch_at(None, 0, 2)
    with pytest.raises(ValueError, match="n_pairs"):
        task.replace(n_pairs=-1)


def test_registry_and_rendering():
    for name, cls in TASKS.items():
        task = make_task(name, seq_len=300)
        assert isinstance(task, cls) and task.name == name and task.seq_len == 300
        assert task.vocab_size <= tiny().vocab_size
        assert dataclasses.replace(task) == task and hash(task) == hash(cls(seq_len=300))
        assert make_task(name, filler_ids=[132, 256]) == make_task(name), "JSON lists accepted"
        assert name in task.describe()
        text = task.format_example(task.batch(0, 2), 1)
        assert text.startswith("<bos> ") and "<q>" in text and len(text) < 1000
        assert text.count("→") == task.scored_per_example
    assert "<key> " in make_task("passkey").format_example(make_task("passkey").batch(0, 1))


def test_module_docstring_example():
    assert doctest.testmod(tasks).failed == 0
