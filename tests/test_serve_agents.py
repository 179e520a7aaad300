"""A run whose samples come from a user's agent file through the endpoint
(``RunConfig.agent``, ``rlaxkit.serve.agents``)."""

from __future__ import annotations

import json
import textwrap

import pytest

from rlaxkit.config.run import small_run_config
from rlaxkit.runtime import Experiment
from rlaxkit.serve.agents import attach_agent

AGENT = """
import itertools

calls = itertools.count()


def run(client, model, prompt):
    if next(calls) == 0:
        raise RuntimeError("the first conversation fails")
    reply = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt}]
    )
    return reply.choices[0].message.content
"""


@pytest.mark.slow
def test_an_openai_client_agent_produces_a_trained_batch(tmp_path, monkeypatch):
    from openai._base_client import SyncHttpxClientWrapper as Pool  # what OpenAI() builds

    built = []  # HTTP clients: one per agent copy, whose pool each session's client shares
    init = Pool.__init__
    monkeypatch.setattr(
        Pool, "__init__", lambda self, *a, **k: built.append(1) or init(self, *a, **k)
    )
    path = tmp_path / "agent.py"
    path.write_text(textwrap.dedent(AGENT))
    config = small_run_config(
        "steps=1",
        "sft.steps=0",
        "batching.equal_rewards=keep",  # an untrained model: every reward 0
        "runtime.mode=concurrent",
        "runtime.num_workers=1",
        f"agent.file={path}",
        "episodes.max_episode_tokens=16",  # the endpoint's context: 16 + 16 tokens
        "agent.copies=4",
        "agent.slots=8",
        "agent.chat_template=\"{% for m in messages %}{{ m['content'] }}{% endfor %}\"",
    )
    with Experiment(config, run_dir=tmp_path / "run") as exp:
        collector = attach_agent(exp)
        assert collector.endpoint.url.startswith("http://127.0.0.1:")
        exp.step()
        groups = exp.last_batch["groups"]
        assert exp.version == 1 and len(groups) == config.staleness.batch_size
        for group in groups:
            assert [r.sample_index for r in group.rollouts] == list(range(config.group_size))
            for rollout in group.rollouts:
                assert rollout.worker_id == "endpoint" and rollout.policy_mask.all()
                assert rollout.first_version == 0 and rollout.reward_info["turns"] == 1
        # The failed conversation dropped its group, with the reason counted.
        assert exp.buffer.counts()["dropped_by_reason"] == {"agent_error": 1}
    stats = json.loads((tmp_path / "run" / "agent.json").read_text())
    # Conversations still open at the end are dropped as "stopped".
    assert stats["agent_error"] == 1 and stats["dropped"].pop("agent_error") == 1
    assert set(stats["dropped"]) <= {"stopped"}
    assert stats["requests"] >= config.staleness.batch_size * config.group_size
    assert len(built) == 4, len(built)  # agent.copies
