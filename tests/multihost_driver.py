"""A driver that a test runs on one host of a ``NetnsCluster`` and steers by files.

``python tests/multihost_driver.py CONFIG RUN_DIR CACHE_DIR --pause-holding-after 2
--pause-after 4`` runs ``Experiment(config, run_dir)`` (the config places it:
``runtime.backend=ray``, ``ray.address``) step by step. After each ``--pause-after N``
step it writes ``RUN_DIR/paused-<N>.json`` (the step, the prompts each worker holds,
and the address of its host) and waits for the test to create ``RUN_DIR/go-<N>``
(having, say, killed a host meanwhile). ``--pause-holding-after N`` pauses after the
first step from ``N`` on at which some worker holds prompts: which steps those are
depends on the sampled rollouts, so on the warm start's and the programs' float
rounding. At ``config.steps`` it checks the accounting and writes
``RUN_DIR/result.json``: the summary and the history.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from rlaxkit.config.run import RunConfig
from rlaxkit.runtime import Experiment

GO_WAIT_S = 600.0  # how long a pause waits for the test
ADDRESS_WAIT_S = 10.0  # how long to ask an actor where it runs


def node_address(handle) -> str | None:
    """The address of the Ray node an actor runs on (``None``: not placed yet)."""
    import ray

    where = handle.__ray_call__.remote(lambda _: ray.util.get_node_ip_address())
    done, _ = ray.wait([where], timeout=ADDRESS_WAIT_S)
    return ray.get(done[0]) if done else None


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("config")
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("cache_dir")
    parser.add_argument("--pause-after", type=int, action="append", default=[])
    parser.add_argument("--pause-holding-after", type=int, action="append", default=[])
    args = parser.parse_args()
    config = RunConfig.from_yaml(args.config)
    pauses = sorted(
        [(n, False) for n in args.pause_after] + [(n, True) for n in args.pause_holding_after]
    )
    with Experiment(config, run_dir=args.run_dir, cache_dir=args.cache_dir) as exp:
        while exp.version < config.steps:
            exp.step()
            exp.check_accounting()
            if not pauses or exp.version < pauses[0][0]:
                continue
            in_flight = exp.fleet.in_flight()
            after, holding = pauses[0]
            if holding and not any(in_flight.values()):
                continue
            pauses.pop(0)
            paused = {
                "step": exp.version,
                "in_flight": in_flight,
                "addresses": {w.worker_id: node_address(w.handle) for w in exp.workers},
            }
            (args.run_dir / f"paused-{after}.json").write_text(json.dumps(paused))
            go = args.run_dir / f"go-{after}"
            deadline = time.monotonic() + GO_WAIT_S
            while not go.exists() and time.monotonic() < deadline:
                time.sleep(0.2)
        result = {"summary": exp.summary(), "history": exp.history}
    (args.run_dir / "result.json").write_text(json.dumps(result, default=str))


if __name__ == "__main__":
    main()
