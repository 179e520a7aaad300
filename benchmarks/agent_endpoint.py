"""Does an agent written only against the OpenAI client learn through the endpoint? (#64)

Runs ``rlaxkit train configs/agent_calculator.yaml``: the trainer's weights served on an
OpenAI-compatible endpoint on 127.0.0.1 (``rlaxkit.serve``), ``agent.copies`` copies of
``configs/agent_calculator.py`` (the ``openai`` client, nothing of rlaxkit) playing the
calculator task against it, and GRPO on their conversations as sampled. The held-out
evaluation (pass@1 on 100 test problems, 4 episodes each, before and after RL) plays
the task's episodes on the trained weights.

Then it measures the endpoint's overhead per request: the same turns (same contexts,
seeds and budgets, so the same tokens, which it checks), one at a time, through the
``openai`` client and the HTTP server, and straight on an ``InferenceEngine`` of the
same settings; overhead is the difference of their mean wall times.

The last line is one JSON object: ``pass1_before``, ``pass1_after``, ``pass1_gain``,
``tool_use_rate_before`` / ``_after``, ``wall_s`` (the whole training job: warm start,
RL, two evaluations), ``steps``, ``agent_requests`` and ``agent_request_mean_s`` (the
run's requests), ``dropped_sessions``, and ``request_s_endpoint``,
``request_s_engine``, ``overhead_ms_per_request``.

``--quick`` trains a third of the steps and evaluates 40 problems.

What it showed, on 2 otherwise idle CPU cores: the full run (120 steps of 32 groups)
took held-out pass@1 0.028 -> 0.430 (+40.2 points) and tool_use_rate 0.25 -> 0.85 in
495 s (warm start, RL, two evaluations); 62 035 agent requests, none dropped. The
endpoint's overhead: 46.0 ms a turn through the ``openai`` client and HTTP against
38.3 ms straight on the engine, 7.7 ms per request, the same tokens on all 41 turns.
Before each agent copy shared one client's connections (``rlaxkit.serve.agents``), a
new ``openai.OpenAI`` per session cost 20-40 ms of CPU: the same run took 1 190 s
(8.6 s a step against 3.3 s) for +34.8 points.

Usage::

    python benchmarks/agent_endpoint.py --quick
    python benchmarks/agent_endpoint.py [--run-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from rlaxkit.cli import run_job
from rlaxkit.config.run import RunConfig

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "agent_calculator.yaml"


def config_for(quick: bool) -> RunConfig:
    """The shipped config; with ``quick`` a third of its steps and 40 held-out problems."""
    config = RunConfig.from_yaml(CONFIG, [f"agent.file={ROOT / 'configs/agent_calculator.py'}"])
    if not quick:
        return config
    return RunConfig.from_overrides(
        [f"steps={max(config.steps // 3, 1)}", "eval.num_problems=40"], base=config
    )


def overhead(config: RunConfig, run_dir: Path, requests: int = 40) -> dict[str, float]:
    """Mean wall seconds of one turn through the endpoint and straight on an engine."""
    import openai

    from rlaxkit.inference import InferenceEngine
    from rlaxkit.models import load_hf_checkpoint
    from rlaxkit.runtime.build import build_task
    from rlaxkit.serve import ChatEndpoint, EndpointConfig

    model, tokenizer = load_hf_checkpoint(run_dir / "final")
    assert tokenizer is not None
    agent = config.agent
    assert agent is not None
    settings = EndpointConfig(
        temperature=config.sampling.temperature,
        max_new_tokens=config.sampling.max_new_tokens,
        max_prompt_tokens=config.runtime.max_prompt_tokens + config.episodes.max_episode_tokens,
        slots=agent.slots,
        chunk_steps=config.runtime.chunk_steps,
        chat_template=agent.chat_template,
        stop=agent.stop,
    )
    task = build_task(config)
    prompts = [task.format_prompt(p) for p in task.problems("test", requests)]
    budget = 16
    with ChatEndpoint(model, tokenizer, settings) as endpoint:
        engine = InferenceEngine(
            model,
            endpoint.engine.config,
            num_slots=settings.slots,
            max_prompt_len=settings.max_prompt_tokens,
            chunk_steps=settings.chunk_steps,
        )
        client = openai.OpenAI(base_url=endpoint.url, api_key="none", max_retries=0)
        served, direct, same = [], [], 0
        for k, prompt in enumerate([prompts[0], *prompts]):  # the first warms both up
            began = time.perf_counter()
            reply = client.chat.completions.create(
                model=settings.model_name,
                messages=[{"role": "user", "content": prompt}],
                max_tokens=budget,
                seed=k,
            )
            served.append(time.perf_counter() - began)
            began = time.perf_counter()
            engine.submit(
                tokenizer.encode(prompt),
                k * 1_000_003 % 2**31,
                max_new_tokens=budget,
                request_id=k,
                sample_index=0,
            )
            (completion,) = engine.run()
            direct.append(time.perf_counter() - began)
            same += reply.choices[0].model_extra["token_ids"] == completion.tokens.tolist()
    if same != len(served):
        raise AssertionError(f"only {same} of {len(served)} turns gave the engine's tokens")
    endpoint_s, engine_s = statistics.mean(served[1:]), statistics.mean(direct[1:])
    return {
        "request_s_endpoint": endpoint_s,
        "request_s_engine": engine_s,
        "overhead_ms_per_request": 1000 * (endpoint_s - engine_s),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a third of the RL steps")
    parser.add_argument("--run-dir", help="where the run goes (default: a temporary one)")
    args = parser.parse_args(argv)
    config = config_for(args.quick)
    with tempfile.TemporaryDirectory() as scratch:
        run_dir = Path(args.run_dir or scratch) / "agent"
        summary = run_job(config, run_dir, progress=False, log=print)
        agent: dict[str, Any] = json.loads((run_dir / "agent.json").read_text())
        costs = overhead(config, run_dir)
    report = {
        "quick": args.quick,
        "steps": summary["steps"],
        "pass1_before": summary["pass@1_before"],
        "pass1_after": summary["pass@1_after"],
        "pass1_gain": summary["pass@1_after"] - summary["pass@1_before"],
        "tool_use_rate_before": summary["tool_use_rate_before"],
        "tool_use_rate_after": summary["tool_use_rate_after"],
        "wall_s": summary["wall_s"],
        "agent_requests": agent["requests"],
        "agent_request_mean_s": agent["request_mean_s"],
        "dropped_sessions": agent["dropped"],
        **costs,
    }
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
