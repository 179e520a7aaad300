"""The replay log alone: ops in the order recorded, a JSON round trip, a reset on each new
base version, the weights a replay needs, loud errors for malformed ops."""

import doctest
import json

import pytest

from rlaxkit.worker import replay_log
from rlaxkit.worker.replay_log import Decode, ReplayLog, Submit, UpdateWeights, parse_ops


def recorded_log() -> ReplayLog:
    """Base version 3; prompts 5 and 2 submitted a chunk apart; version 4 taken in flight."""
    log = ReplayLog()
    log.reset(3, "params-3")
    log.submitted(5)
    log.decoded()
    log.submitted(2)
    log.updated(4, "params-4", recompute_cache=True)
    log.decoded()
    return log


def test_ops_are_kept_in_the_order_recorded():
    log = recorded_log()
    assert log.base_version == 3
    assert log.ops == [
        Submit(5),
        Decode(),
        Submit(2),
        UpdateWeights(4, recompute_cache=True),
        Decode(),
    ]
    assert log.state_dict() == {
        "base_version": 3,
        "ops": [["s", 5], ["d"], ["s", 2], ["u", 4, True], ["d"]],
    }


def test_state_dict_round_trips_through_json():
    log = recorded_log()
    state = json.loads(json.dumps(log.state_dict()))
    assert state == log.state_dict()
    assert parse_ops(state["ops"]) == log.ops
    # Tuples read the same as lists (the Ray fleet builds ``("s", group_id)``).
    assert parse_ops([("s", 5), ("d",), ("u", 4, False)]) == [
        Submit(5),
        Decode(),
        UpdateWeights(4, recompute_cache=False),
    ]


def test_weights_are_the_base_and_every_update():
    log = recorded_log()
    assert log.weights() == {3: "params-3", 4: "params-4"}
    log.weights()[9] = "not kept"  # a copy
    assert sorted(log.weights()) == [3, 4]


def test_a_reset_starts_an_empty_log_on_the_new_base_version():
    log = recorded_log()
    log.reset(4, "params-4")
    assert log.state_dict() == {"base_version": 4, "ops": []}
    assert log.weights() == {4: "params-4"}
    log.reset(None)  # no engine: nothing to replay, no weights to keep
    assert log.state_dict() == {"base_version": None, "ops": []}
    assert log.weights() == {}


@pytest.mark.parametrize("entry", [["x", 1], ["s"], ["d", 0], ["u", 1], "s"])
def test_a_malformed_op_is_refused(entry):
    with pytest.raises(ValueError, match="replay log op"):
        parse_ops([["d"], entry])


def test_module_examples_run():
    assert doctest.testmod(replay_log).failed == 0
