"""collate and TrainBatch: layout, bucketing, alignment with token_logprobs, bad input."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

from rlaxkit.data.batch import BucketSpec, Sample, TrainBatch, collate
from rlaxkit.models import positions_from_mask
from rlaxkit.trainer.logprobs import token_logprobs

jitted_logprobs = nnx.jit(token_logprobs)


def sample(prompt, completion, group="a", reward=1.0, versions=0, logprobs=None):
    logprobs = [-0.5] * len(completion) if logprobs is None else logprobs
    return Sample(
        prompt_tokens=prompt,
        completion_tokens=completion,
        behaviour_logprobs=logprobs,
        versions=versions,
        reward=reward,
        group_id=group,
    )


def test_layout_by_hand():
    samples = [
        sample(
            [5, 6], [7, 8, 9], group="q1", reward=1.0, versions=[3, 3, 4], logprobs=[-1, -2, -3]
        ),
        sample([5], [4], group="q2", reward=0.0, versions=2, logprobs=[-0.25]),
        sample([5, 6, 7], [1], group="q1", reward=0.5),
    ]
    batch = collate(samples, bucket=BucketSpec(lengths=(4, 8), batch_sizes=(2, 4)), pad_token_id=0)
    assert batch.shape == (4, 8)  # 3 rows -> 4; longest row 5 tokens -> 8
    np.testing.assert_array_equal(batch.tokens[0], [5, 6, 7, 8, 9, 0, 0, 0])
    np.testing.assert_array_equal(batch.attention_mask[1], [1, 1, 0, 0, 0, 0, 0, 0])
    np.testing.assert_array_equal(batch.loss_mask[0], [0, 0, 1, 1, 1, 0, 0, 0])
    # The log-prob of completion token j sits at t = len(prompt) + j.
    np.testing.assert_array_equal(batch.behaviour_logprobs[0], [0, 0, -1, -2, -3, 0, 0, 0])
    np.testing.assert_array_equal(batch.behaviour_logprobs[1], [0, -0.25, 0, 0, 0, 0, 0, 0])
    np.testing.assert_array_equal(batch.versions[0], [-1, -1, 3, 3, 4, -1, -1, -1])
    np.testing.assert_array_equal(batch.versions[1], [-1, 2, -1, -1, -1, -1, -1, -1])
    np.testing.assert_array_equal(batch.rewards, [1.0, 0.0, 0.5, 0.0])
    # Group ids are dense in order of appearance; the padding row is its own group.
    np.testing.assert_array_equal(batch.group_ids, [0, 1, 0, 3])
    np.testing.assert_array_equal(batch.sequence_mask, [1, 1, 1, 0])
    assert not batch.attention_mask[3].any() and not batch.loss_mask[3].any()


def test_behaviour_logprobs_line_up_with_token_logprobs(tiny_model):
    # A sampler that records token_logprobs of its own tokens must give ratio 1 exactly
    # where the loss looks: check the alignment through collate.
    rng = np.random.RandomState(0)
    rows = [
        (rng.randint(1, 64, p).tolist(), rng.randint(1, 64, c).tolist())
        for p, c in [(3, 4), (2, 6)]
    ]
    samples = []
    for prompt, completion in rows:
        tokens = jnp.asarray([prompt + completion])
        alone = jitted_logprobs(tiny_model, tokens, jnp.arange(tokens.shape[1])[None], None)
        samples.append(sample(prompt, completion, logprobs=np.asarray(alone[0, len(prompt) :])))
    batch = collate(samples, bucket=BucketSpec(lengths=(16,), batch_sizes=(4,)))
    mask = jnp.asarray(batch.attention_mask)
    batched = jitted_logprobs(
        tiny_model, jnp.asarray(batch.tokens), positions_from_mask(mask), mask
    )
    picked = batch.loss_mask > 0
    np.testing.assert_allclose(
        np.asarray(batched)[picked], batch.behaviour_logprobs[picked], atol=1e-5
    )


def test_batch_is_a_pytree_without_its_absent_fields():
    batch = collate([sample([1], [2])])
    assert len(jax.tree.leaves(batch)) == 8
    with_adv = batch.replace(advantages=np.zeros(batch.shape, np.float32))
    assert len(jax.tree.leaves(with_adv)) == 9
    assert isinstance(jax.tree.map(lambda x: x, with_adv), TrainBatch)


def test_bucketing_rounds_up_and_refuses_overflow():
    spec = BucketSpec(lengths=(8, 16), batch_sizes=(2, 4))
    assert (spec.length_for(8), spec.length_for(9), spec.batch_size_for(3)) == (8, 16, 4)
    assert collate([sample([1] * 5, [2] * 6)] * 3, bucket=spec).shape == (4, 16)
    with pytest.raises(ValueError, match="lengths: 17 exceeds the largest bucket 16"):
        collate([sample([1] * 10, [2] * 7)], bucket=spec)
    with pytest.raises(ValueError, match="batch_sizes"):
        collate([sample([1], [2])] * 5, bucket=spec)


@pytest.mark.parametrize("lengths", [(), (16, 8), (0, 8), (8, 8)])
def test_bucket_spec_validates(lengths):
    with pytest.raises(ValueError, match="lengths"):
        BucketSpec(lengths=lengths)


@pytest.mark.parametrize(
    "bad, message",
    [
        (sample([], [1]), "sample 1: prompt_tokens is empty"),
        (sample([1], [2, 3], logprobs=[-1.0]), "sample 1: behaviour_logprobs has 1 entries"),
        (sample([1], [2], logprobs=[float("nan")]), "sample 1: behaviour_logprobs must be finite"),
        (sample([1], [2, 3], versions=[1]), "sample 1: versions has 1 entries"),
        (sample([1], [2], reward=float("inf")), "sample 1: reward must be finite"),
    ],
)
def test_bad_samples_fail_loudly_naming_sample_and_field(bad, message):
    with pytest.raises(ValueError, match=message):
        collate([sample([1], [2]), bad])
    with pytest.raises(ValueError, match="at least one sample"):
        collate([])


def _collate_row_by_row(samples, bucket, pad):
    """The layout written out one row at a time: what ``collate`` must equal."""
    ends = [len(s.prompt_tokens) + len(s.completion_tokens) for s in samples]
    rows, width = bucket.batch_size_for(len(samples)), bucket.length_for(max(ends))
    out = {
        "tokens": np.full((rows, width), pad, np.int32),
        "behaviour_logprobs": np.zeros((rows, width), np.float32),
        "versions": np.full((rows, width), -1, np.int32),
        "loss_mask": np.zeros((rows, width), np.float32),
        "attention_mask": np.zeros((rows, width), bool),
        "rewards": np.zeros((rows,), np.float32),
        "group_ids": np.arange(rows, dtype=np.int32),
        "sequence_mask": np.arange(rows) < len(samples),
    }
    dense = {}
    for row, s in enumerate(samples):
        p, end = len(s.prompt_tokens), ends[row]
        policy = np.ones(end - p, bool) if s.policy_mask is None else np.asarray(s.policy_mask)
        versions = np.broadcast_to(np.asarray(s.versions), (end - p,))
        out["tokens"][row, :end] = [*s.prompt_tokens, *s.completion_tokens]
        out["attention_mask"][row, :end] = True
        out["loss_mask"][row, p:end] = policy
        out["behaviour_logprobs"][row, p:end] = np.where(policy, s.behaviour_logprobs, 0.0)
        out["versions"][row, p:end] = np.where(policy, versions, -1)
        out["rewards"][row] = s.reward
        out["group_ids"][row] = dense.setdefault(s.group_id, len(dense))
    return out


_token = st.integers(0, 50)


@st.composite
def _samples(draw):
    n = draw(st.integers(0, 6))
    completion = draw(st.lists(_token, min_size=n, max_size=n))
    masked = draw(st.booleans())
    return Sample(
        prompt_tokens=draw(st.lists(_token, min_size=1, max_size=5)),
        completion_tokens=np.array(completion, np.int32) if draw(st.booleans()) else completion,
        behaviour_logprobs=draw(st.lists(st.floats(-5, 0, width=32), min_size=n, max_size=n)),
        versions=draw(st.integers(0, 3) | st.lists(st.integers(0, 3), min_size=n, max_size=n)),
        reward=draw(st.floats(0, 1)),
        group_id=draw(st.sampled_from("abc")),
        policy_mask=draw(st.lists(st.booleans(), min_size=n, max_size=n)) if masked else None,
    )


@settings(max_examples=60, deadline=None)
@given(st.lists(_samples(), min_size=1, max_size=7), st.sampled_from([None, (4, 8, 16)]))
def test_collate_equals_the_row_by_row_layout(samples, lengths):
    bucket = BucketSpec() if lengths is None else BucketSpec(lengths=lengths)
    batch = collate(samples, bucket=bucket, pad_token_id=7)
    for name, expected in _collate_row_by_row(samples, bucket, 7).items():
        np.testing.assert_array_equal(getattr(batch, name), expected, err_msg=name)


def test_policy_mask_of_the_wrong_length_names_the_sample():
    bad = Sample(
        prompt_tokens=[1],
        completion_tokens=[2, 3],
        behaviour_logprobs=[-1.0, 0.0],
        versions=0,
        reward=1.0,
        group_id="a",
        policy_mask=[True],
    )
    with pytest.raises(ValueError, match="sample 1: policy_mask has 1 entries"):
        collate([sample([1], [2]), bad])
