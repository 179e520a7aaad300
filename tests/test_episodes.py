"""Multi-turn episodes: the trained tokens are the sampled tokens plus the observation
ids, environment tokens carry no loss and no gradient, runs are deterministic, turn and
token budgets hold, failing or hanging tools become counted error observations, and a
multi-turn rollout survives a checkpoint."""

import dataclasses
import json
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rlaxkit.algorithms import PRESETS, AdvantageInputs, LossInputs, compute_advantages, rl_loss
from rlaxkit.algorithms import algorithm as preset
from rlaxkit.data.batch import Sample, collate
from rlaxkit.data.buffer import RolloutBuffer
from rlaxkit.data.rollout import Rollout
from rlaxkit.inference import InferenceEngine, SamplingConfig
from rlaxkit.models import CharTokenizer, ModelConfig, Transformer
from rlaxkit.rules.policies import StalenessPolicy
from rlaxkit.rules.trace import MemoryTrace
from rlaxkit.tasks import CalculatorEnvironment, CalculatorTask, tool_use_metrics
from rlaxkit.tasks.episodes import (
    EpisodeConfig,
    StepResult,
    episode_sampling,
    run_episodes,
)
from rlaxkit.trainer.logprobs import logprobs_and_entropy
from sim.calibration.turns import fit_turns

TASK = CalculatorTask()
TOKENIZER = CharTokenizer(TASK.alphabet())
PROBLEMS = TASK.problems("train", 3)


class RecordingEngine(InferenceEngine):
    """Keeps every request's prompt and every completion it returns, per request id, and
    counts the turns resumed in a parked row."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.reset_records()

    def resume(self, request_id, observation, rng, **kwargs):
        self.resumed += 1
        return super().resume(request_id, observation, rng, **kwargs)

    def submit(self, prompt, rng, *, request_id=None, **kwargs):
        self.prompts.setdefault(request_id, []).append(list(prompt))
        return super().submit(prompt, rng, request_id=request_id, **kwargs)

    def step(self):
        finished = super().step()
        for c in finished:
            self.completions.setdefault(c.request_id, []).append(c)
        return finished

    def reset_records(self):
        self.prompts, self.completions, self.resumed = {}, {}, 0


@pytest.fixture(scope="module")
def engine():
    """One tiny random model's engine for the module: turns of at most 8 tokens, ending
    at the end token, at ``</calc>`` or at ``5`` (a one-token tool stop, so that many
    of a random model's turns end in a tool call)."""
    config = ModelConfig(
        family="qwen3",
        vocab_size=TOKENIZER.vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
    )
    model = Transformer(config, rngs=nnx.Rngs(0))
    sampling = episode_sampling(SamplingConfig(max_new_tokens=8), TOKENIZER, ("</calc>", "5"))
    return RecordingEngine(model, sampling, num_slots=4, max_prompt_len=64, chunk_steps=8)


class ScriptedEnvironment:
    """Answers every turn with an observation, alternately text and token ids; ends the
    episode after ``done_after`` turns (never, by default). ``fail`` maps a turn to
    ``"raise"`` or ``"hang"`` (blocks until ``release`` is set)."""

    tool_stops = ("</calc>",)
    release = threading.Event()

    def __init__(self, done_after=None, fail=None):
        self.done_after, self.fail = done_after, fail or {}
        self.turn, self.given = 0, []

    def reset(self, problem):
        return problem.prompt

    def step(self, action):
        self.turn += 1
        if self.fail.get(self.turn) == "raise":
            raise RuntimeError("the tool broke")
        if self.fail.get(self.turn) == "hang":
            self.release.wait(10)
        if self.turn == self.done_after:
            return StepResult(reward=1.0, done=True)
        observation = f"={self.turn}\n" if self.turn % 2 else [3 + self.turn, 4, 5]
        self.given.append(TOKENIZER.encode(observation) if self.turn % 2 else observation)
        return StepResult(observation=observation)

    def error_observation(self, outcome, detail):
        return [6, 6] if outcome == "timeout" else [7]


def run(engine, config, make_env=ScriptedEnvironment, seed=0, **kwargs):
    engine.reset_records()
    envs = []

    def make():
        envs.append(make_env())
        return envs[-1]

    return run_episodes(engine, make, PROBLEMS, TOKENIZER, config, seed=seed, **kwargs), envs


def test_trained_tokens_are_the_sampled_tokens_plus_the_observations(engine):
    config = EpisodeConfig(samples_per_problem=2, max_turns=3, max_episode_tokens=48)
    weights = iter([None, (engine.params, 1)])  # a new version after the first chunk
    episodes, envs = run(engine, config, weight_source=lambda: next(weights, None))
    assert len(episodes) == 6
    for index, (episode, env) in enumerate(zip(episodes, envs, strict=True)):
        assert episode.finish_reason == "max_turns" and episode.turns == 3
        completions = engine.completions[index]
        assert len(completions) == 3 and len(env.given) == 3
        expected, mask, logprobs = [], [], []
        prompt = TOKENIZER.encode(episode.problem.prompt)
        for turn, completion in enumerate(completions):
            # Each turn's request is the prompt plus everything written before it.
            assert engine.prompts[index][turn] == prompt + expected
            expected += completion.tokens.tolist()
            mask += [True] * completion.num_tokens
            logprobs += completion.logprobs.tolist()
            if turn < 2:  # the last observation is not appended: no turn follows it
                expected += env.given[turn]
                mask += [False] * len(env.given[turn])
                logprobs += [0.0] * len(env.given[turn])
        rollout = episode.to_rollout(group_id=index // 2)
        assert rollout.prompt_tokens.tolist() == prompt
        assert rollout.completion_tokens.tolist() == expected
        assert rollout.policy_mask.tolist() == mask
        np.testing.assert_array_equal(rollout.behaviour_logprobs, np.float32(logprobs))
        assert (rollout.versions[~rollout.policy_mask] == -1).all()
        assert set(rollout.versions[rollout.policy_mask].tolist()) <= {0, 1}
        assert rollout.last_version == 1  # later turns ran under the new weights

        batch = collate([rollout])
        p, n = len(prompt), len(expected)
        np.testing.assert_array_equal(batch.tokens[0, p : p + n], expected)
        np.testing.assert_array_equal(batch.loss_mask[0, p : p + n], np.float32(mask))
        assert batch.loss_mask[0, :p].sum() == 0 and batch.loss_mask[0, p + n :].sum() == 0
    engine.update_weights(engine.params, 0)


def test_the_engine_stops_after_a_tool_call_and_at_the_end_token(engine):
    assert engine.config.n == 1
    stops = tuple(tuple(TOKENIZER.encode(text)) for text in ("</calc>", "5"))
    assert engine.config.stop_sequences == stops
    assert TOKENIZER.eos_id in engine.config.stop_tokens
    model, sampling = (engine.graphdef, engine.params), SamplingConfig(n=2, stop_tokens=(1,))
    several = RecordingEngine(model, sampling, num_slots=2, max_prompt_len=16)
    with pytest.raises(ValueError, match=r"episodes need an engine with n=1 \(got 2\)"):
        run(several, EpisodeConfig(max_episode_tokens=8))


def test_keeping_the_kv_cache_gives_the_episodes_of_prefilling_every_turn(engine):
    config = EpisodeConfig(samples_per_problem=2, max_turns=3, max_episode_tokens=48)
    prefilled, _ = run(engine, config, seed=3)
    kept, _ = run(engine, dataclasses.replace(config, keep_cache=True), seed=3)
    assert engine.resumed > 0  # some turns went on in their parked rows
    assert engine.idle and engine.num_parked == 0  # rows of ended episodes released
    for a, b in zip(prefilled, kept, strict=True):
        assert (a.tokens, a.policy_mask, a.versions) == (b.tokens, b.policy_mask, b.versions)
        assert (a.turns, a.finish_reason) == (b.turns, b.finish_reason)
        np.testing.assert_allclose(a.behaviour_logprobs, b.behaviour_logprobs, atol=1e-5)


def test_same_seed_same_episodes_and_another_seed_others(engine):
    config = EpisodeConfig(samples_per_problem=2, max_turns=2, max_episode_tokens=32)
    first, _ = run(engine, config, seed=5)
    again, _ = run(engine, config, seed=5)
    other, _ = run(engine, config, seed=6)
    assert [e.tokens for e in first] == [e.tokens for e in again]
    assert [e.behaviour_logprobs for e in first] == [e.behaviour_logprobs for e in again]
    assert [e.tokens for e in first] != [e.tokens for e in other]
    # The samples of one problem differ from each other.
    assert first[0].tokens != first[1].tokens


def test_turn_and_token_budgets_and_the_environment_ending_an_episode(engine):
    ends, _ = run(
        engine,
        EpisodeConfig(max_turns=4, max_episode_tokens=48),
        make_env=lambda: ScriptedEnvironment(2),
    )
    assert [(e.turns, e.finish_reason, e.reward) for e in ends] == [(2, "stop", 1.0)] * 3
    one, _ = run(engine, EpisodeConfig(max_turns=1, max_episode_tokens=48))
    assert [(e.turns, e.finish_reason) for e in one] == [(1, "max_turns")] * 3
    assert all(all(e.policy_mask) for e in one)
    short, _ = run(engine, EpisodeConfig(max_turns=10, max_episode_tokens=12))
    for episode in short:
        assert len(episode.tokens) <= 12 and episode.finish_reason == "length"
    with pytest.raises(ValueError, match="prompt width"):
        run(engine, EpisodeConfig(max_episode_tokens=60))


def test_a_tool_that_raises_or_hangs_becomes_a_counted_error_observation(engine):
    ScriptedEnvironment.release.clear()
    config = EpisodeConfig(max_turns=3, max_episode_tokens=48, step_timeout_s=0.3)
    try:
        episodes, _ = run(
            engine, config, make_env=lambda: ScriptedEnvironment(fail={1: "raise", 2: "hang"})
        )
    finally:
        ScriptedEnvironment.release.set()
    for episode in episodes:
        assert episode.finish_reason == "max_turns"
        assert [s.outcome for s in episode.steps] == ["error", "timeout", "ok"]
        assert episode.failures("error") == 1 and episode.failures("timeout") == 1
        assert "RuntimeError: the tool broke" in episode.steps[0].info["error"]
        assert [s.observation_ids for s in episode.steps[:2]] == [(7,), (6, 6)]
        rollout = episode.to_rollout(0)
        assert rollout.reward_info["tool_errors"] == 1
        assert rollout.reward_info["tool_timeouts"] == 1
        env_tokens = rollout.completion_tokens[~rollout.policy_mask].tolist()
        assert env_tokens == [7, 6, 6]


class SlowEnvironment(ScriptedEnvironment):
    """A scripted environment whose steps take the seconds of ``delays_s`` in turn."""

    def __init__(self, delays_s):
        super().__init__()
        self.delays_s = delays_s

    def step(self, action):
        time.sleep(self.delays_s[self.turn % len(self.delays_s)])
        return super().step(action)


def test_every_environment_step_is_timed_and_written_as_a_tool_call_event(engine):
    trace = MemoryTrace()
    config = EpisodeConfig(samples_per_problem=2, max_turns=3, max_episode_tokens=48)
    episodes, _ = run(engine, config, make_env=lambda: SlowEnvironment([0.0, 0.05]), trace=trace)
    events = [e for e in trace.events if e.kind == "tool_call"]
    assert len(events) == sum(e.turns for e in episodes) == 18  # 6 episodes, 3 turns
    for index, episode in enumerate(episodes):
        mine = [e for e in events if e["sample"] == f"{index // 2}/{index % 2}"]
        assert [e["turn"] for e in mine] == [0, 1, 2]
        assert [e["outcome"] for e in mine] == ["ok"] * 3
        assert [e["duration_s"] for e in mine] == [s.duration_s for s in episode.steps]
        assert [e["observation_tokens"] for e in mine] == [
            len(s.observation_ids) for s in episode.steps
        ]
        assert [e["action_tokens"] for e in mine] == [
            len(s.action.token_ids) for s in episode.steps
        ]
        # The second step sleeps 50 ms, the others do not.
        assert episode.steps[1].duration_s >= 0.05
        assert episode.steps[1].duration_s > max(
            episode.steps[0].duration_s, episode.steps[2].duration_s
        )
        assert mine[1].t >= mine[0].t + 0.05  # each event is timed at its step's end
        mask = episode.policy_mask
        policy_versions = [v for v, p in zip(episode.versions, mask, strict=True) if p]
        assert mine[-1].version == policy_versions[-1] == 0
    # The simulator's calibration reads these events: every step's duration, 3 calls
    # for each of the 6 episodes.
    fit = fit_turns(trace.events)
    assert sorted(fit.tool_latency_s.values) == sorted(
        s.duration_s for episode in episodes for s in episode.steps
    )
    assert fit.turns.values == (3.0,) * 6


def test_a_timed_out_step_lasts_until_it_is_given_up_on_the_given_clock(engine):
    ScriptedEnvironment.release.clear()
    ticks = iter(range(1_000_000))
    trace = MemoryTrace()
    config = EpisodeConfig(max_turns=2, max_episode_tokens=48, step_timeout_s=0.2)
    try:
        episodes, _ = run(
            engine,
            config,
            make_env=lambda: ScriptedEnvironment(fail={1: "hang"}),
            trace=trace,
            clock=lambda: float(next(ticks)),  # one second a reading
            trace_actor="worker-3",
        )
    finally:
        ScriptedEnvironment.release.set()
    for episode in episodes:
        assert [s.outcome for s in episode.steps] == ["timeout", "ok"]
        assert all(s.duration_s >= 1.0 and s.duration_s == int(s.duration_s) for s in episode.steps)
    events = [e for e in trace.events if e.kind == "tool_call"]
    assert {e.actor for e in events} == {"worker-3"}
    assert sorted(e["outcome"] for e in events) == ["ok"] * 3 + ["timeout"] * 3


def test_calculator_episodes_run_and_are_scored(engine):
    # A random model rarely closes a call: most episodes are one scored answer turn.
    config = EpisodeConfig(samples_per_problem=2, max_turns=3, max_episode_tokens=32)
    episodes, _ = run(engine, config, make_env=lambda: CalculatorEnvironment(TASK))
    for episode in episodes:
        assert episode.finish_reason in ("stop", "max_turns", "length")
        if episode.finish_reason == "stop":
            assert episode.steps[-1].info["final"] is True
    metrics = tool_use_metrics(episodes)
    assert metrics["pass_rate"] == 0.0 and 0.0 <= metrics["tool_call_rate"] <= 1.0


def multi_turn_rollout(group=0, index=0, reward=1.0):
    """Prompt [1, 2]; completion: two policy tokens, two tool tokens, one policy token."""
    return Rollout(
        group_id=group,
        sample_index=index,
        problem_id="p",
        prompt_tokens=np.array([1, 2], np.int32),
        completion_tokens=np.array([5, 6, 9, 9, 7], np.int32),
        behaviour_logprobs=np.array([-0.5, -1.0, 0.0, 0.0, -0.25], np.float32),
        versions=np.array([3, 4, -1, -1, 2], np.int32),
        reward=reward,
        finish_reason="stop",
        policy_mask=np.array([1, 1, 0, 0, 1], bool),
    )


def test_staleness_counts_from_the_oldest_policy_token_and_masks_are_checked():
    rollout = multi_turn_rollout()
    assert (rollout.first_version, rollout.last_version) == (2, 4)
    assert rollout.num_policy_tokens == 3 and rollout.num_tokens == 5
    ones = np.ones(2, np.int32)
    single = Rollout(1, 0, "p", ones, ones, np.zeros(2), np.array([0, 1]), 0.0, "stop")
    assert single.policy_mask.tolist() == [True, True] and single.first_version == 0
    fields = dict(rollout.__dict__)
    del fields["first_version"], fields["last_version"]
    with pytest.raises(ValueError, match="environment tokens"):
        Rollout(**fields | {"versions": np.array([3, 4, 0, -1, 2], np.int32)})
    with pytest.raises(ValueError, match="policy_mask has shape"):
        Rollout(**fields | {"policy_mask": np.ones(4, bool)})


def test_collate_masks_environment_tokens_of_samples():
    sample = Sample(
        prompt_tokens=[1],
        completion_tokens=[5, 9, 6],
        behaviour_logprobs=[-0.5, -3.0, -0.1],
        versions=2,
        reward=1.0,
        group_id="g",
        policy_mask=[True, False, True],
    )
    batch = collate([sample])
    assert batch.loss_mask[0, :4].tolist() == [0.0, 1.0, 0.0, 1.0]
    assert batch.versions[0, :4].tolist() == [-1, 2, -1, 2]
    assert batch.behaviour_logprobs[0, :4].tolist() == [0.0, -0.5, 0.0, pytest.approx(-0.1)]
    with pytest.raises(ValueError, match="policy_mask has 2 entries for 3"):
        collate([Sample(**sample.__dict__ | {"policy_mask": [True, False]})])


def test_a_multi_turn_rollout_survives_a_checkpoint_and_old_ones_read_as_all_policy():
    buffer = RolloutBuffer(StalenessPolicy(max_staleness=8, batch_size=1), group_size=1)
    buffer.issue(0, "p")
    buffer.add(multi_turn_rollout(), 4)
    state = json.loads(json.dumps(buffer.state_dict()))  # what the checkpoint writes
    restored = RolloutBuffer(StalenessPolicy(max_staleness=8, batch_size=1), group_size=1)
    restored.load_state_dict(state)
    (ready,) = restored.ledger.ready.values()
    (rollout,) = ready.payload.rollouts
    original = multi_turn_rollout()
    for name in ("completion_tokens", "behaviour_logprobs", "versions", "policy_mask"):
        np.testing.assert_array_equal(getattr(rollout, name), getattr(original, name))
    assert (ready.first_version, ready.last_version) == (2, 4)
    # A checkpoint written before policy masks existed: no key, all policy tokens.
    del state["ready"][0]["rollouts"][0]["policy_mask"]
    state["ready"][0]["rollouts"][0]["versions"] = [3, 4, 1, 1, 2]
    restored.load_state_dict(state)
    (ready,) = restored.ledger.ready.values()
    assert ready.payload.rollouts[0].policy_mask.all()


@pytest.mark.parametrize("name", PRESETS.names())
def test_environment_tokens_get_no_gradient_under_every_registered_objective(name):
    """d loss / d logits is exactly zero at every position that predicts an environment
    token (the logits at ``t - 1`` predict token ``t``), and not zero elsewhere."""
    algorithm = preset(name)
    batch = collate([multi_turn_rollout(0, 0), multi_turn_rollout(0, 1, reward=0.0)])
    rows, width = batch.shape
    key = jax.random.key(0)
    logits = jax.random.normal(key, (rows, width, 16))
    tokens = jnp.asarray(batch.tokens) % 16
    mask = jnp.asarray(batch.loss_mask)
    values = jax.random.normal(jax.random.fold_in(key, 1), (rows, width))
    advantages, returns = compute_advantages(
        AdvantageInputs(
            rewards=jnp.asarray(batch.rewards),
            group_ids=jnp.asarray(batch.group_ids),
            sequence_mask=jnp.asarray(batch.sequence_mask),
            loss_mask=mask,
            values=values,
        ),
        algorithm.advantage,
    )

    def loss(logits):
        logp, entropy = logprobs_and_entropy(logits[:, :-1], tokens[:, 1:], 1.0)
        logp, entropy = jnp.pad(logp, ((0, 0), (1, 0))), jnp.pad(entropy, ((0, 0), (1, 0)))
        inputs = LossInputs(
            logprobs=logp,
            behaviour_logprobs=jnp.asarray(batch.behaviour_logprobs),
            advantages=advantages,
            loss_mask=mask,
            proximal_logprobs=jax.lax.stop_gradient(logp) - 0.1,
            versions=jnp.asarray(batch.versions),
            proximal_version=jnp.int32(5),
            ref_logprobs=jax.lax.stop_gradient(logp) + 0.2,
            entropy=entropy,
            values=values,
            old_values=values + 0.1,
            returns=returns if returns is not None else values,
        )
        return rl_loss(inputs, dataclasses.replace(algorithm.loss, entropy_coef=0.01))[0]

    grads = np.asarray(jax.grad(loss)(logits))
    predicts = np.zeros((rows, width), bool)
    predicts[:, :-1] = np.asarray(batch.loss_mask[:, 1:]) > 0  # predicts a policy token
    environment = np.zeros((rows, width), bool)
    environment[:, :-1] = np.asarray(batch.attention_mask[:, 1:]) & ~predicts[:, :-1]
    assert environment[:, 3:5].all()  # the two tool tokens sit at positions 4 and 5
    assert np.all(grads[environment] == 0.0)
    assert np.abs(grads[predicts]).sum(axis=-1).min() > 0
