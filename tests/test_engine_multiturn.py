"""Multi-turn requests in the continuous-batching engine: a row stopped by a tool call is
parked with its KV cache, the observation is prefilled at its offset and decoding goes
on; a parked row can be released for other requests."""

import dataclasses
import functools

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_engine import assert_same, peaked_model

from rlaxkit.inference import InferenceEngine, SamplingConfig, bucket_length, generate
from rlaxkit.models import relayout
from rlaxkit.trainer.logprobs import token_logprobs
from rlaxkit.util.jaxutil import count_compilations

GREEDY = SamplingConfig(temperature=0.0, max_new_tokens=8)
SLOTS, MAX_PROMPT, MAX_CONTEXT = 2, 16, 36
OBSERVATION = [7, 8, 9]


@pytest.fixture(scope="module")
def models():
    return [peaked_model(seed) for seed in range(2)]


@functools.partial(nnx.jit, static_argnames=("width",))
def _sequence_logprobs(model, tokens, length, width):
    positions = jnp.arange(width)[None]
    return token_logprobs(model, tokens[None], positions, positions < length)[0]


def trainer_logprobs(model, context, completion):
    """``token_logprobs`` (temperature 1) of ``completion`` after ``context``: one forward
    pass over the whole episode, padded to ``MAX_CONTEXT + 8`` tokens."""
    full = np.concatenate([context, completion]).astype(np.int32)
    sequence = np.zeros(MAX_CONTEXT + 8, np.int32)
    sequence[: len(full)] = full
    out = _sequence_logprobs(model, sequence, len(full), width=len(sequence))
    return np.asarray(out)[len(context) : len(full)]


def tool_call(model, prompt, config=GREEDY, rng=0, at=3):
    """A 2-token stop sequence that ``prompt``'s completion (no stops, key ``rng``) first
    completes at token ``at`` or later: the "tool call" that ends turn 1 there."""
    free = dataclasses.replace(config, stop_sequences=())
    tokens = generate(model, [prompt], free, [rng]).tokens[0, 0].tolist()
    pairs = list(zip(tokens, tokens[1:], strict=False))
    for i in range(at - 1, len(pairs)):
        if pairs[i] not in pairs[:i]:
            return pairs[i]
    raise AssertionError(f"no fresh token pair in {tokens}")


def engine_for(model, pair, config=GREEDY, **options):
    config = dataclasses.replace(config, stop_sequences=(pair,))
    kwargs = {"num_slots": SLOTS, "max_prompt_len": MAX_PROMPT, "max_context_len": MAX_CONTEXT}
    return InferenceEngine(model, config, **kwargs | options)


def first_turn(engine, prompt, rng=0):
    """Submits ``prompt`` with ``hold`` and runs it to its tool call."""
    request = engine.submit(prompt, rng, hold=True)
    (turn,) = engine.run()
    assert turn.parked and turn.finish_reason == "stop"
    assert turn.tokens[-2:].tolist() == list(engine.config.stop_sequences[0])
    assert engine.idle and engine.num_parked == 1 and engine.num_running == 0
    return request, turn


@pytest.mark.parametrize(("temperature", "scan_layers"), [(0.0, False), (1.0, False), (1.0, True)])
def test_a_resumed_turn_equals_recomputing_the_whole_episode(models, temperature, scan_layers):
    # With stacked blocks the observation's prefill writes the stacked cache in one scan.
    model, prompt = relayout(models[0], scan_layers=scan_layers), [5, 17, 2, 40, 33]
    config = dataclasses.replace(GREEDY, temperature=temperature)
    pair = tool_call(model, prompt, config)
    engine = engine_for(model, pair, config)
    request, turn1 = first_turn(engine, prompt)
    engine.resume(request, OBSERVATION, 1)
    assert engine.num_queued == 1 and not engine.idle
    (turn2,) = engine.run()
    assert not turn2.parked and engine.idle and engine.num_parked == 0
    context = np.concatenate([prompt, turn1.tokens, OBSERVATION])
    assert turn2.prompt_tokens.tolist() == context.tolist()
    # Every token's log-prob is the trainer's over the whole episode, prompt + turn 1 +
    # observation + turn 2 (turn 2 is 8 tokens: the budget, or fewer at the tool call).
    for prefix, turn in ((prompt, turn1), (context, turn2)):
        expected = trainer_logprobs(model, prefix, turn.tokens)
        np.testing.assert_allclose(turn.logprobs, expected, atol=1e-5, rtol=0)
        np.testing.assert_allclose(turn.plain_logprobs, expected, atol=1e-5, rtol=0)
    # The same tokens as prefilling the history again as a new prompt with the same key.
    engine.submit(context, 1, request_id=7)
    (again,) = engine.run()
    assert_same(turn2, again)


def test_samples_of_a_request_park_and_resume_separately_in_one_batch(models):
    model, prompt = models[0], [5, 17, 2, 40, 33]
    engine = engine_for(model, tool_call(model, prompt), dataclasses.replace(GREEDY, n=2))
    request = engine.submit(prompt, 0, hold=True)
    turn1 = engine.run()
    assert [c.parked for c in turn1] == [True, True] and engine.parked == [(0, 0), (0, 1)]
    observations = {0: OBSERVATION, 1: [4, 5, 6, 7, 8, 9, 10]}  # one prefill, two widths
    for j, observation in observations.items():
        engine.resume(request, observation, j + 1, sample_index=j, hold=False)
    assert engine.num_queued == 2
    turn2 = engine.run()
    assert engine.idle and engine.parked == [] and [c.sample_index for c in turn2] == [0, 1]
    for c in turn2:
        context = np.concatenate(
            [prompt, turn1[c.sample_index].tokens, observations[c.sample_index]]
        )
        assert c.prompt_tokens.tolist() == context.tolist()
        expected = trainer_logprobs(model, context, c.tokens)
        np.testing.assert_allclose(c.logprobs, expected, atol=1e-5, rtol=0)
        again = generate(model, [context], engine.config, [0]).completion(0)
        assert c.tokens.tolist() == again.tokens.tolist()
    assert engine.submit(prompt, 0, request_id=request) == request  # done: its id is free


def test_other_rows_decode_while_a_row_is_parked_and_a_released_row_is_refilled(models):
    model, parked_prompt = models[0], [5, 17, 2, 40, 33]
    other, late = [9, 9, 31, 4], [12, 60]
    engine = engine_for(model, tool_call(model, parked_prompt), chunk_steps=2)
    alone = generate(model, [other, late], engine.config, [0, 0])
    request = engine.submit(parked_prompt, 0, hold=True)
    engine.submit(other, 0, request_id=1)
    done = []
    while not engine.num_parked:
        done += engine.step()
    assert [c.request_id for c in done if c.parked] == [request]
    assert engine.num_running == 1 and not engine.idle  # the other row goes on
    engine.submit(late, 0, request_id=2)
    engine.step()
    assert engine.num_queued == 1  # both rows taken: the parked one is not refilled
    engine.release(request)
    assert engine.num_parked == 0 and engine.parked == []
    done += engine.step()
    assert engine.num_queued == 0  # the released row took the late request
    done += engine.run()
    by_id = {c.request_id: c for c in done if not c.parked}
    assert_same(by_id[1], alone.completion(0))
    assert_same(by_id[2], alone.completion(1))
    with pytest.raises(ValueError, match="request 0 sample 0 is not parked: it is unknown"):
        engine.resume(request, OBSERVATION, 1)


def test_bad_resumes_and_releases_fail_loudly(models):
    model, prompt = models[0], [5, 17, 2, 40, 33]
    engine = engine_for(model, tool_call(model, prompt))
    with pytest.raises(ValueError, match="hold=True needs config.stop_sequences"):
        InferenceEngine(model, GREEDY, num_slots=1, max_prompt_len=16).submit([1], 0, hold=True)
    with pytest.raises(ValueError, match="max_context_len must be >= max_prompt_len"):
        engine_for(model, (1, 2), max_context_len=23)
    with pytest.raises(ValueError, match="request 3 has no parked row"):
        engine.release(3)
    request, turn = first_turn(engine, prompt)
    with pytest.raises(ValueError, match="is not parked: it is unknown or finished"):
        engine.resume(5, OBSERVATION, 1)
    with pytest.raises(ValueError, match="request 0 sample 1 is not parked"):
        engine.resume(request, OBSERVATION, 1, sample_index=1)
    with pytest.raises(ValueError, match="observation is empty"):
        engine.resume(request, [], 1)
    with pytest.raises(ValueError, match=r"outside \[0, 64\)"):
        engine.resume(request, [64], 1)
    # The context so far + the observation + the budget must fit the row's cache.
    so_far = len(prompt) + turn.num_tokens
    fits = MAX_CONTEXT + 1 - so_far - GREEDY.max_new_tokens
    message = (
        f"{so_far} tokens so far \\+ {fits + 1} observation tokens \\+ 8 new tokens need "
        f"{MAX_CONTEXT + 1} cache slots, more than max_context_len \\({MAX_CONTEXT}\\)"
    )
    with pytest.raises(ValueError, match=message):
        engine.resume(request, [1] * (fits + 1), 1)
    engine.resume(request, [1] * fits, 1, hold=False)
    with pytest.raises(ValueError, match="request 0 sample 0 is not parked: it is already"):
        engine.resume(request, OBSERVATION, 1)
    with pytest.raises(ValueError, match="request 0 is already queued, running or parked"):
        engine.submit(prompt, 0, request_id=request)
    # A full row, whose observation's bucket runs past the cache's last slot.
    assert so_far - 1 + bucket_length(fits) > MAX_CONTEXT
    (last,) = engine.run()
    assert not last.parked and engine.idle
    expected = trainer_logprobs(model, last.prompt_tokens, last.tokens)
    np.testing.assert_allclose(last.logprobs, expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("recompute_cache", [False, True])
def test_versions_and_log_probs_when_weights_change_between_and_within_turns(
    models, recompute_cache
):
    prompt = [5, 17, 2, 40, 33]
    pair = tool_call(models[0], prompt)
    engine = engine_for(models[0], pair, chunk_steps=3)
    request, turn1 = first_turn(engine, prompt)
    engine.update_weights(models[1], 1, recompute_cache=recompute_cache)
    engine.resume(request, OBSERVATION, 1, hold=False)
    turn2 = engine.step()
    assert turn2 == []  # 3 of 8 tokens
    engine.update_weights(models[1], 2, recompute_cache=recompute_cache)
    (turn2,) = engine.run()
    assert turn1.versions.tolist() == [0] * turn1.num_tokens
    assert turn2.versions.tolist() == [1] * 3 + [2] * 5
    context = turn2.prompt_tokens
    expected = trainer_logprobs(models[1], context, turn2.tokens)
    if recompute_cache:
        # The parked row's cache was rebuilt under the new weights: turn 2 is exactly the
        # new model's, token for token, as if its history were prefilled again.
        np.testing.assert_allclose(turn2.logprobs, expected, atol=1e-5, rtol=0)
        fresh = engine_for(models[1], pair)
        fresh.submit(context, 1)
        (again,) = fresh.run()
        assert turn2.tokens.tolist() == again.tokens.tolist()
    else:
        # The history's keys and values are still version 0's.
        assert np.abs(turn2.logprobs - expected).max() > 1e-3


def test_no_recompilation_on_a_second_episode(models):
    """Same bucket shapes, other observations, keys, budgets and weight versions."""
    model, prompt = models[0], [5, 17, 2, 40, 33]
    engine = engine_for(model, tool_call(model, prompt))

    def episode(observation, rng, budget, version):
        request, _ = first_turn(engine, prompt)
        engine.update_weights(model, version, recompute_cache=True)
        engine.resume(request, observation, rng, max_new_tokens=budget)
        (turn,) = engine.run()
        if turn.parked:
            engine.release(request)
        assert engine.idle and engine.num_parked == 0
        return turn

    episode(OBSERVATION, 1, 8, 1)
    with count_compilations() as compiles:
        turn = episode([3, 1, 4, 1, 5, 9], 2, 5, 2)
    assert compiles.count == 0
    assert turn.versions.tolist() == [2] * turn.num_tokens
