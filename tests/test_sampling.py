"""The KV-cache sampler: truncation properties, greedy = full recomputation, log-prob
parity with the trainer, stops, determinism and compilation counts."""

import dataclasses
import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from rlaxkit.inference import (
    SamplingConfig,
    bucket_length,
    bucket_rows,
    compile_generate,
    generate,
    generate_by_recompute,
    kept_tokens,
    make_text_generate,
    sample_tokens,
)
from rlaxkit.inference.results import key_data, split_model
from rlaxkit.inference.sampler import inverse_cdf_sample
from rlaxkit.models import CharTokenizer, ModelConfig, abstract_model, load_hf_checkpoint
from rlaxkit.trainer.logprobs import token_logprobs
from rlaxkit.util.jaxutil import count_compilations

FIXTURES = Path(__file__).parent / "fixtures" / "hf"
VOCAB = 64


def peaked_model(seed=0, vocab=VOCAB):
    """A tiny Qwen3-shaped model with N(0, 0.3^2) weights (norm scales 1 + N(0, 0.3^2)), so
    its next-token distributions are far from flat (mean log-prob about -2.7 against -4.2
    for uniform)."""
    config = ModelConfig(
        family="qwen3",
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
    )
    model = abstract_model(config)  # shapes only; numpy fills them, so nothing compiles
    rng = np.random.RandomState(seed)
    params = nnx.state(model, nnx.Param)
    flat = [
        (path, (1.0 if "norm" in str(path[-2]) else 0.0) + 0.3 * rng.standard_normal(x.shape))
        for path, x in nnx.to_flat_state(params)
    ]
    nnx.update(model, nnx.from_flat_state([(p, jnp.asarray(v, jnp.float32)) for p, v in flat]))
    return model


@pytest.fixture(scope="module")
def model():
    return peaked_model()


def ragged_prompts(lengths, seed=0, vocab=VOCAB):
    rng = np.random.RandomState(seed)
    return [rng.randint(0, vocab, n).tolist() for n in lengths]


@nnx.jit
def _forward(model, tokens, positions, mask):
    return model(tokens, positions, mask)


def greedy_by_full_forward(model, prompt, steps, width):
    """Independent reference: argmax of the training forward, one token at a time."""
    sequence = list(prompt)
    for _ in range(steps):
        tokens = np.zeros((1, width), np.int32)
        tokens[0, : len(sequence)] = sequence
        mask = np.arange(width)[None] < len(sequence)
        logits = _forward(model, tokens, np.arange(width)[None], mask)
        sequence.append(int(np.argmax(np.asarray(logits)[0, len(sequence) - 1])))
    return sequence[len(prompt) :]


# --- config and buckets ---------------------------------------------------------------


@pytest.mark.parametrize(
    "field, value",
    [
        ("temperature", -0.1),
        ("top_k", -1),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("min_p", 1.0),
        ("min_p", -0.1),
        ("max_new_tokens", 0),
        ("n", 0),
        ("stop_tokens", (-3,)),
        ("stop_sequences", ((),)),
    ],
)
def test_config_errors_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingConfig(**{field: value})


def test_config_is_hashable_with_lists_normalised():
    a = SamplingConfig(stop_tokens=[3, 4], stop_sequences=[[1, 2]])
    b = SamplingConfig(stop_tokens=(3, 4), stop_sequences=((1, 2),))
    assert a == b and hash(a) == hash(b)
    assert SamplingConfig(top_p=0.9).truncates and SamplingConfig(temperature=0).greedy
    assert not SamplingConfig(temperature=0, top_k=5).truncates


def test_buckets():
    assert [bucket_rows(r) for r in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, 16]
    assert [bucket_length(n) for n in (1, 16, 17, 33, 64)] == [16, 16, 32, 64, 64]
    assert bucket_length(40, cap=48) == 48
    with pytest.raises(ValueError, match="exceeds"):
        bucket_length(50, cap=48)


# --- truncation: properties of the pure filter ----------------------------------------

# Distinct logits on a 1/8 grid: no two tokens are tied, not even after float rounding
# of their probabilities. Two vocab sizes only, so few shapes are compiled.
distinct_logits = st.sampled_from([7, 24]).flatmap(
    lambda vocab: hnp.arrays(
        np.float32,
        (vocab,),
        elements=st.integers(-64, 64).map(lambda i: i / 8),
        unique=True,
    )
)


def _probs(logits):
    p = np.exp(logits - logits.max())
    return p / p.sum()


@settings(max_examples=60, deadline=None)
@given(logits=distinct_logits, k=st.integers(1, 30))
def test_top_k_keeps_exactly_the_k_largest(logits, k):
    keep = np.asarray(kept_tokens(jnp.asarray(logits), top_k=k))
    expected = np.zeros(len(logits), bool)
    expected[np.argsort(-logits)[: min(k, len(logits))]] = True
    np.testing.assert_array_equal(keep, expected)


def test_top_k_keeps_every_tie_at_the_boundary():
    keep = kept_tokens(jnp.array([3.0, 1.0, 3.0, 2.0, 3.0]), top_k=2)
    assert np.asarray(keep).tolist() == [True, False, True, False, True]


@settings(max_examples=60, deadline=None)
@given(logits=distinct_logits, top_p=st.floats(0.01, 0.99))
def test_top_p_keeps_the_shortest_prefix_reaching_the_mass(logits, top_p):
    keep = np.asarray(kept_tokens(jnp.asarray(logits), top_p=top_p))
    probs = _probs(logits.astype(np.float64))
    # The kept set is a top set: every kept token is likelier than every dropped one.
    assert keep[np.argmax(logits)]
    if (~keep).any():
        assert logits[keep].min() > logits[~keep].max()
    # It reaches the mass, and is the shortest such set (float32 slack of 1e-5).
    assert probs[keep].sum() >= top_p - 1e-5
    assert probs[keep].sum() - probs[keep].min() < top_p + 1e-5


@settings(max_examples=60, deadline=None)
@given(logits=distinct_logits, min_p=st.floats(0.001, 0.99))
def test_min_p_keeps_tokens_at_least_min_p_of_the_top(logits, min_p):
    keep = np.asarray(kept_tokens(jnp.asarray(logits), min_p=min_p))
    ratio = _probs(logits.astype(np.float64)) / _probs(logits.astype(np.float64)).max()
    clear = np.abs(ratio - min_p) > 1e-5 * max(min_p, 1e-3)  # away from the boundary
    np.testing.assert_array_equal(keep[clear], (ratio >= min_p)[clear])
    assert keep[np.argmax(logits)]


@settings(max_examples=30, deadline=None)
@given(
    logits=hnp.arrays(np.float32, (16,), elements=st.floats(-6, 6, width=32)),
    top_k=st.sampled_from([0, 1, 3, 10]),
    top_p=st.floats(0.05, 1.0),
    min_p=st.floats(0.0, 0.9),
    temperature=st.floats(0.2, 2.0),
    seed=st.integers(0, 2**31 - 1),
)
def test_sampled_tokens_never_leave_the_kept_set(logits, top_k, top_p, min_p, temperature, seed):
    config = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    rows = 256
    keys = jax.random.split(jax.random.key(seed), rows)
    batch = jnp.broadcast_to(jnp.asarray(logits), (rows, 16))
    tokens, logprobs, plain = sample_tokens(keys, batch, config)
    scaled = jnp.asarray(logits) / np.float32(temperature)
    keep = np.asarray(kept_tokens(scaled, top_k=top_k, top_p=top_p, min_p=min_p))
    assert keep[np.asarray(tokens)].all()
    # Renormalising over the kept set: logprob = plain - log(kept mass) >= plain.
    kept_mass = np.asarray(jax.nn.softmax(scaled))[keep].sum()
    np.testing.assert_allclose(logprobs, plain - np.log(kept_mass), atol=1e-5)


def test_untruncated_sampling_records_equal_logprobs_and_greedy_is_argmax():
    logits = jnp.asarray(np.random.RandomState(0).standard_normal((8, 32)) * 3, jnp.float32)
    keys = jax.random.split(jax.random.key(1), 8)
    sample = jax.jit(sample_tokens, static_argnums=2)
    tokens, logprobs, plain = sample(keys, logits, SamplingConfig(temperature=0.7))
    np.testing.assert_array_equal(logprobs, plain)
    tokens, logprobs, plain = sample(keys, logits, SamplingConfig(temperature=0))
    np.testing.assert_array_equal(tokens, np.argmax(logits, axis=-1))
    # Greedy records log-probs under temperature 1.
    expected = np.asarray(jax.nn.log_softmax(logits))[np.arange(8), np.asarray(tokens)]
    np.testing.assert_allclose(logprobs, expected, atol=1e-6)
    np.testing.assert_array_equal(logprobs, plain)


def test_inverse_cdf_sampling_draws_the_softmax_distribution_and_skips_masked_tokens():
    # p = softmax([0, log 2, log 3, -inf, log 4]) = [1, 2, 3, 0, 4] / 10; 40000 draws give
    # a standard error of sqrt(0.4 * 0.6 / 40000) ~ 0.0025 per frequency, so 0.012 is
    # about 5 standard errors.
    logits = jnp.log(jnp.array([1.0, 2.0, 3.0, 0.0, 4.0]))
    keys = jax.random.split(jax.random.key(0), 40_000)
    tokens = jax.jit(inverse_cdf_sample)(keys, jnp.broadcast_to(logits, (40_000, 5)))
    frequencies = np.bincount(np.asarray(tokens), minlength=5) / 40_000
    assert frequencies[3] == 0.0
    np.testing.assert_allclose(frequencies, [0.1, 0.2, 0.3, 0.0, 0.4], atol=0.012)


@settings(max_examples=60, deadline=None)
@given(
    vocab=st.sampled_from([1, 7, 8, 9, 64, 65, 300, 2048]),
    rows=st.integers(1, 6),
    masked=st.floats(0.0, 0.95),
    scale=st.floats(0.1, 20.0),
    seed=st.integers(0, 10_000),
)
def test_inverse_cdf_sampling_inverts_the_cdf_over_blocks(vocab, rows, masked, scale, seed):
    """The two-level search picks, for each row's uniform ``u``, the token where the
    cumulative weight (in float64) crosses ``u · Σ w``: to float32 rounding, whatever
    block the crossing lies in, and never a masked token (whole masked blocks
    included)."""
    rng = np.random.RandomState(seed)
    logits = rng.randn(rows, vocab).astype(np.float32) * scale
    mask = rng.rand(rows, vocab) < masked
    if vocab > 16:  # a run of masked blocks
        mask[:, vocab // 4 : vocab // 2] = True
    mask[np.arange(rows), rng.randint(0, vocab, rows)] = False
    logits = np.where(mask, -np.inf, logits)
    keys = jax.random.split(jax.random.key(seed), rows)
    tokens = np.asarray(jax.jit(inverse_cdf_sample)(keys, jnp.asarray(logits)))
    uniform = np.asarray(jax.vmap(jax.random.uniform)(keys), np.float64)
    weights = np.exp(logits.astype(np.float64) - logits.max(axis=-1, keepdims=True))
    cdf = np.cumsum(weights, axis=-1)
    for b, token in enumerate(tokens):
        assert np.isfinite(logits[b, token])
        target = uniform[b] * cdf[b, -1]
        slack = 1e-5 * cdf[b, -1]
        assert cdf[b, token] - weights[b, token] <= target + slack
        assert cdf[b, token] >= target - slack


# --- generation: equivalence and parity -----------------------------------------------
# Most tests share BASE (temperature 1, 16 new tokens), 4 decode rows and prompt width 16,
# so they share compiled programs.

BASE = SamplingConfig(temperature=1.0, max_new_tokens=16)
GREEDY = SamplingConfig(temperature=0, max_new_tokens=16)


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama"])
def test_greedy_with_kv_cache_equals_full_recomputation_on_hf_fixtures(family):
    model, _ = load_hf_checkpoint(FIXTURES / family, with_tokenizer=False)
    prompts = ragged_prompts([5, 13, 1, 9], seed=1, vocab=model.config.vocab_size)
    result = generate(model, prompts, GREEDY, 0)
    for i, prompt in enumerate(prompts):
        expected = greedy_by_full_forward(model, prompt, 16, width=32)
        assert result.completion(i).tokens.tolist() == expected, f"{family} prompt {i}"


@functools.partial(nnx.jit, static_argnames=("width",))
def _trainer_logprobs(model, sequence, length, temperature, width):
    tokens = jnp.zeros((1, width), jnp.int32).at[0, : sequence.shape[0]].set(sequence)
    positions = jnp.arange(width)[None]
    return token_logprobs(model, tokens, positions, positions < length, temperature)[0]


def trainer_logprobs(model, prompt, completion, temperature):
    """``rlaxkit.trainer.logprobs.token_logprobs`` of the completion tokens given the prompt (the
    sequence right-padded to 32 tokens, so one program serves every length)."""
    sequence = np.concatenate([prompt, completion]).astype(np.int32)
    padded = np.zeros(32, np.int32)
    padded[: len(sequence)] = sequence
    out = _trainer_logprobs(model, padded, len(sequence), np.float32(temperature), width=32)
    return np.asarray(out)[len(prompt) : len(sequence)]


def test_greedy_with_kv_cache_equals_full_recomputation_on_a_random_model(model):
    prompts = ragged_prompts([3, 16, 1, 8], seed=2)
    result = generate(model, prompts, GREEDY, 0)
    for i, prompt in enumerate(prompts):
        c = result.completion(i)
        assert c.tokens.tolist() == greedy_by_full_forward(model, prompt, 16, width=32)
        # Greedy records log-probs under temperature 1.
        expected = trainer_logprobs(model, prompt, c.tokens, 1.0)
        np.testing.assert_allclose(c.logprobs, expected, atol=1e-5, rtol=0)


def test_sampling_with_kv_cache_equals_recompute_sampler_for_the_same_keys(model):
    prompts = ragged_prompts([4, 9], seed=3)
    config = SamplingConfig(temperature=0.8, top_p=0.9, top_k=20, max_new_tokens=16, n=2)
    result = generate(model, prompts, config, 5)
    recomputed = generate_by_recompute(model, prompts, config, 5)
    np.testing.assert_array_equal(result.tokens, recomputed.tokens)
    np.testing.assert_allclose(result.logprobs, recomputed.logprobs, atol=1e-5)
    np.testing.assert_allclose(result.plain_logprobs, recomputed.plain_logprobs, atol=1e-5)


@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_recorded_logprobs_equal_the_trainers_recomputation(model, temperature):
    prompts = ragged_prompts([3, 11, 1, 7], seed=4)
    config = dataclasses.replace(BASE, temperature=temperature)
    result = generate(model, prompts, config, 1)
    assert result.logprobs[result.mask].mean() > -3.5  # far from flat (uniform: -4.16)
    for i, prompt in enumerate(prompts):
        c = result.completion(i)
        expected = trainer_logprobs(model, prompt, c.tokens, temperature)
        np.testing.assert_allclose(c.logprobs, expected, atol=1e-5, rtol=0)
        np.testing.assert_array_equal(c.logprobs, c.plain_logprobs)


def test_truncated_sampling_records_both_distributions(model):
    prompts = ragged_prompts([5, 2, 9, 4], seed=5)
    config = SamplingConfig(temperature=0.7, top_p=0.8, min_p=0.05, max_new_tokens=16)
    result = generate(model, prompts, config, 2)
    for i, prompt in enumerate(prompts):
        c = result.completion(i)
        expected = trainer_logprobs(model, prompt, c.tokens, 0.7)
        np.testing.assert_allclose(c.plain_logprobs, expected, atol=1e-5, rtol=0)
        assert (c.logprobs >= c.plain_logprobs - 1e-6).all()
    assert (result.logprobs > result.plain_logprobs + 1e-4).any()  # truncation did something


# --- determinism, stops, samples, versions ---------------------------------------------


def test_same_seed_same_completions_and_independent_of_batch(model):
    prompts = ragged_prompts([4, 10, 6, 2], seed=7)
    keys = [jax.random.key(i + 30) for i in range(4)]
    a = generate(model, prompts, BASE, keys)
    b = generate(model, prompts, BASE, keys)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_array_equal(a.logprobs, b.logprobs)
    alone = generate(model, prompts[1:2], BASE, keys[1:2])
    np.testing.assert_array_equal(alone.tokens[0], a.tokens[1])
    other = generate(model, prompts, BASE, [jax.random.key(i + 99) for i in range(4)])
    assert not np.array_equal(other.tokens, a.tokens)


def test_n_samples_share_a_prefill_and_sample_zero_is_the_single_sample(model):
    """Sample j uses fold_in(prompt key, j), so sample 0 of n is the n = 1 sample."""
    prompts = ragged_prompts([7, 3, 12, 5], seed=8)
    many = generate(model, prompts[:1], dataclasses.replace(BASE, n=4), 3)
    one = generate(model, prompts, BASE, 3)
    np.testing.assert_array_equal(many.tokens[0, 0], one.tokens[0, 0])
    # Equal up to float rounding: the prefills ran at different batch shapes.
    np.testing.assert_allclose(many.logprobs[0, 0], one.logprobs[0, 0], atol=1e-5, rtol=0)
    samples = {tuple(row) for row in many.tokens[0].tolist()}
    assert len(samples) == 4


def test_stop_tokens_end_rows_and_nothing_after_is_scored(model):
    stop = tuple(range(0, VOCAB, 5))  # 13 of 64 ids: rows stop after a few tokens
    config = dataclasses.replace(BASE, n=2, stop_tokens=stop)
    result = generate(model, ragged_prompts([3, 8], seed=9), config, 4, version=7)
    reasons = [r for row in result.finish_reasons for r in row]
    assert "stop" in reasons
    for i in range(2):
        for j in range(2):
            length, reason = int(result.lengths[i, j]), result.finish_reasons[i][j]
            row = result.tokens[i, j, :length].tolist()
            assert not set(row[:-1]) & set(stop)
            assert (row[-1] in stop) == (reason == "stop")
            assert reason == "stop" or length == 16
            assert (result.tokens[i, j, length:] == 0).all()
            assert (result.logprobs[i, j, length:] == 0).all()
            assert (result.plain_logprobs[i, j, length:] == 0).all()
            assert (result.versions[i, j, length:] == -1).all()
            assert (result.versions[i, j, :length] == 7).all()
            assert (result.logprobs[i, j, :length] < 0).all()
    np.testing.assert_array_equal(result.mask, np.arange(16) < result.lengths[..., None])


def test_stop_sequences_end_a_row_at_their_first_occurrence(model):
    prompts = ragged_prompts([4, 6, 3, 5], seed=10)
    free = generate(model, prompts, BASE, 6)
    row = free.tokens[0, 0].tolist()
    # A bigram of the free-running completion that first ends at index 8 or later.
    seen = lambda t: {tuple(row[s - 1 : s + 1]) for s in range(1, t)}  # noqa: E731
    end = next(t for t in range(8, 16) if tuple(row[t - 1 : t + 1]) not in seen(t))
    stop = tuple(row[end - 1 : end + 1])
    cut = generate(model, prompts, dataclasses.replace(BASE, stop_sequences=[stop]), 6)
    c = cut.completion(0)
    assert c.finish_reason == "stop"
    assert c.tokens.tolist() == row[: end + 1]
    for i in range(1, 4):  # the other rows are prefixes of their free-running selves
        other = cut.completion(i).tokens.tolist()
        assert other == free.tokens[i, 0, : len(other)].tolist()


def test_per_prompt_budgets(model):
    prompts = ragged_prompts([2, 3, 4, 1], seed=11)
    result = generate(model, prompts, BASE, 0, max_new_tokens=[1, 16, 5, 2])
    assert result.lengths[:, 0].tolist() == [1, 16, 5, 2]
    assert all(reasons == ("length",) for reasons in result.finish_reasons)
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(model, [[1]], BASE, 0, max_new_tokens=17)


def test_bad_prompts_fail_loudly(model):
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        generate(model, [[1], []], BASE, 0)
    with pytest.raises(ValueError, match="outside"):
        generate(model, [[VOCAB]], BASE, 0)


def test_no_recompilation_within_seen_buckets(model):
    config = dataclasses.replace(BASE, n=2)
    graphdef, params = nnx.split(model)
    generate((graphdef, params), ragged_prompts([5, 9, 3], seed=12), config, 0)
    with count_compilations() as compiles:
        # 4 prompts x 2 samples = 8 rows (bucket 8, like 3 x 2 = 6); widths <= 16.
        generate((graphdef, params), ragged_prompts([16, 1, 7, 2], seed=13), config, 1)
        generate((graphdef, params), ragged_prompts([11, 4, 8], seed=14), config, [7, 8, 9])
    assert compiles.count == 0


def test_compile_generate_leaves_nothing_for_generate_to_compile(model):
    # A shape no other test uses (n=3: 2 prompts x 3 = 6 rows, bucket 8; width 32).
    config = dataclasses.replace(BASE, n=3, max_new_tokens=5)
    graphdef, params = nnx.split(model)
    # Small eager helpers (key folding, dtype conversions) compile once per process
    # whatever the shape; a first call at another shape takes them out of the count.
    generate((graphdef, params), ragged_prompts([3], seed=14), BASE, 1)
    for thread in compile_generate((graphdef, params), config, 2, 20):
        thread.join()
    with count_compilations() as compiles:
        result = generate((graphdef, params), ragged_prompts([20, 17], seed=15), config, 2)
    assert compiles.count == 0
    assert result.tokens.shape == (2, 3, 5)


@pytest.mark.parametrize("seed", [0, 1, 7, 123_456_789, 2**31 - 1, 2**31, 2**40 + 3, -1])
def test_key_data_of_a_seed_equals_jax_random_key(seed):
    expected = np.asarray(jax.random.key_data(jax.random.key(seed)))
    np.testing.assert_array_equal(key_data(seed), expected)
    assert key_data(seed).dtype == np.uint32


def test_equal_graph_definitions_share_one_static_graph(model):
    first, _ = split_model(model)
    second, _ = split_model(nnx.split(model))
    assert first is second


def test_text_adapter():
    tokenizer = CharTokenizer("abcdefgh0123456789+=")
    model = peaked_model(seed=3, vocab=tokenizer.vocab_size)
    text_generate = make_text_generate(model, tokenizer, SamplingConfig(max_new_tokens=8))
    out = text_generate(["1+2=", "ab"], 3, 0)
    assert len(out) == 2 and all(len(samples) == 3 for samples in out)
    assert all(isinstance(s, str) and len(s) <= 8 for samples in out for s in samples)
    assert text_generate(["1+2=", "ab"], 3, 0) == out
    assert text_generate([], 2, 0) == []


def test_text_adapter_in_batches_gives_the_completions_of_one_call():
    """One seed, one answer: in batches (an evaluation's progress bar) prompt ``i`` keeps
    the key one call gives it and every batch the one call's prompt width, so the
    completions are those of one call, whatever the batch size; the ragged last batch is
    padded to the others' shape, so a second call compiles nothing."""
    tokenizer = CharTokenizer("abcdefgh0123456789+=")
    model = peaked_model(seed=3, vocab=tokenizer.vocab_size)
    config = SamplingConfig(max_new_tokens=8)
    # The last prompt (23 tokens) alone widens the prompts from 16 to 32 tokens.
    prompts = ["1+2=", "ab", "17+5=", "h", "3+3=", "99+1=", "c0", "12345678901234567890+1="]
    whole = make_text_generate(model, tokenizer, config)(prompts, 3, 7)
    assert len({s for samples in whole for s in samples}) > 12  # really sampled
    for batch_prompts in (1, 3, 8, 20):
        done = []
        batched = make_text_generate(
            model, tokenizer, config, batch_prompts=batch_prompts, on_batch=done.append
        )
        assert batched(prompts, 3, 7) == whole, batch_prompts
        assert sum(done) == len(prompts) and len(done) == -(-len(prompts) // batch_prompts)
    with count_compilations() as compiles:
        assert batched(prompts, 3, 7) == whole
        assert make_text_generate(model, tokenizer, config, batch_prompts=3)(prompts, 3, 7) == whole
    assert compiles.count == 0
    with pytest.raises(ValueError, match="batch_prompts"):
        make_text_generate(model, tokenizer, config, batch_prompts=0)


def test_a_prompt_past_the_models_positions_is_generated_with_a_warning(tiny_config):
    """Empty prompts are refused by index; a prompt whose tokens plus the new ones pass
    max_position_embeddings is generated, with a warning that names both."""
    from rlaxkit.inference import SamplingConfig, generate
    from rlaxkit.models import Transformer

    model = Transformer(
        dataclasses.replace(tiny_config, max_position_embeddings=8), rngs=nnx.Rngs(0)
    )
    config = SamplingConfig(temperature=1.0, max_new_tokens=4, n=1)
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        generate(model, [[1, 2], []], config, 0)
    with pytest.warns(UserWarning, match=r"prompt 0: 6 tokens \+ 4 new pass the model's max_pos"):
        result = generate(model, [[1, 2, 3, 4, 5, 6]], config, 0)
    assert result.tokens.shape[-1] == 4
