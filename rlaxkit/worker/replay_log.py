"""The replay log of an inference worker: what it did to its engine since the engine was
last idle.

A worker's engine holds partly generated sequences and KV caches that no checkpoint
stores. The log records instead the weight version the engine started from (the
*base*), then every submit, decode chunk and in-flight weight update, in order. Sampling
keys depend only on a request's seed, sample and token index (``InferenceEngine.submit``),
so replaying the log on a fresh engine with the same weights rebuilds the same rows at
the same chunk: a restored worker re-issues its in-flight prompts and continues exactly
where the saved one was. Multi-turn episodes add ``Resume`` (a parked row went on after
an observation's ids) and ``Release`` (a parked row was freed, at an episode's end or,
in concurrent mode, past ``release_after_s``): a replay steps the
environments again, as the worker did, and checks that it resumes and releases the same
rows with the same observations (an environment that answers differently, or a step
that timed out once and not again, makes the replay refuse). The log is short, for the
worker starts a new one whenever its engine drains (every pull in ``between_requests``
mode).

The log is plain Python: it holds the weights it needs (``weights()``, saved once per
checkpoint for all workers) but never reads them, and its ``state_dict()`` is JSON.

>>> log = ReplayLog()
>>> log.reset(0, "weights of version 0")
>>> log.submitted(7)
>>> log.decoded()
>>> log.updated(1, "weights of version 1", recompute_cache=True)
>>> state = log.state_dict()
>>> state
{'base_version': 0, 'ops': [['s', 7], ['d'], ['u', 1, True]]}
>>> parse_ops(state["ops"])
[Submit(group_id=7), Decode(), UpdateWeights(version=1, recompute_cache=True)]
>>> sorted(log.weights())
[0, 1]
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "Decode",
    "Op",
    "Release",
    "ReplayLog",
    "Resume",
    "Submit",
    "UpdateWeights",
    "parse_ops",
    "replay_ops",
]


@dataclass(frozen=True)
class Submit:
    """The worker submitted the ``n`` samples of issued prompt ``group_id``."""

    group_id: int

    def to_json(self) -> list:
        return ["s", self.group_id]


@dataclass(frozen=True)
class Decode:
    """The engine ran one chunk of decode steps."""

    def to_json(self) -> list:
        return ["d"]


@dataclass(frozen=True)
class UpdateWeights:
    """The engine took weight ``version`` with prompts in flight."""

    version: int
    recompute_cache: bool

    def to_json(self) -> list:
        return ["u", self.version, self.recompute_cache]


@dataclass(frozen=True)
class Resume:
    """Sample ``sample_index`` of prompt ``group_id``, parked at a tool call, went on
    after the environment's ``observation`` (token ids)."""

    group_id: int
    sample_index: int
    observation: tuple[int, ...]

    def to_json(self) -> list:
        return ["r", self.group_id, self.sample_index, list(self.observation)]


@dataclass(frozen=True)
class Release:
    """The parked row of sample ``sample_index`` of prompt ``group_id`` was freed: its
    episode ended at a tool call, or (``EpisodeConfig.release_after_s``, concurrent
    mode) its tool ran too long and the turn goes on later as a request of its whole
    context."""

    group_id: int
    sample_index: int

    def to_json(self) -> list:
        return ["x", self.group_id, self.sample_index]


Op = Submit | Decode | UpdateWeights | Resume | Release


def parse_ops(entries: Sequence[Sequence[Any]]) -> list[Op]:
    """The ops of a ``state_dict()["ops"]`` list (lists or tuples, e.g. read from JSON).

    Raises:
        ValueError: an entry is none of ``["s", group_id]``, ``["d"]``,
            ``["u", version, recompute_cache]``, ``["r", group_id, sample_index,
            observation]`` and ``["x", group_id, sample_index]``.
    """
    ops: list[Op] = []
    for entry in entries:
        match entry:
            case ["s", group_id]:
                ops.append(Submit(group_id))
            case ["d"]:
                ops.append(Decode())
            case ["u", version, recompute_cache]:
                ops.append(UpdateWeights(version, recompute_cache))
            case ["r", group_id, sample_index, observation]:
                ops.append(Resume(group_id, sample_index, tuple(observation)))
            case ["x", group_id, sample_index]:
                ops.append(Release(group_id, sample_index))
            case _:
                raise ValueError(
                    f"replay log op {entry!r}: expected ['s', group_id], ['d'], "
                    "['u', version, recompute_cache], ['r', group_id, sample_index, "
                    "observation] or ['x', group_id, sample_index]"
                )
    return ops


def replay_ops(
    ops: Sequence[Op],
    *,
    submit: Callable[[int], None],
    decode: Callable[[], None],
    update_weights: Callable[[int, bool], None],
) -> None:
    """Applies ``ops`` in order: ``submit(group_id)``, ``decode()``,
    ``update_weights(version, recompute_cache)``. ``Resume`` and ``Release`` are not
    applied: the replayed decodes' environments redo them, and the caller compares the
    log it wrote again with ``ops``."""
    for op in ops:
        match op:
            case Submit(group_id=group_id):
                submit(group_id)
            case Decode():
                decode()
            case UpdateWeights(version=version, recompute_cache=recompute_cache):
                update_weights(version, recompute_cache)
            case Resume() | Release():
                pass


class ReplayLog:
    """The ops a worker applied to its engine since the engine was last idle.

    Attributes:
        base_version: the weight version of the idle engine the log starts from;
            ``None`` when the worker has no engine (never pulled, or preempted).
        ops: what the worker did since, oldest first.
    """

    def __init__(self) -> None:
        self.base_version: int | None = None
        self.ops: list[Op] = []
        self._weights: dict[int, object] = {}  # version -> params, the base's first

    def reset(self, version: int | None, params: object = None) -> None:
        """Starts an empty log from an idle engine holding ``params`` of ``version``
        (``None``: no engine)."""
        self.base_version = version
        self.ops = []
        self._weights = {} if version is None else {version: params}

    def submitted(self, group_id: int) -> None:
        """Records a submitted prompt."""
        self.ops.append(Submit(group_id))

    def decoded(self) -> None:
        """Records a decode chunk."""
        self.ops.append(Decode())

    def resumed(self, group_id: int, sample_index: int, observation: tuple[int, ...]) -> None:
        """Records a parked episode resumed after an observation."""
        self.ops.append(Resume(group_id, sample_index, observation))

    def released(self, group_id: int, sample_index: int) -> None:
        """Records a parked episode's row freed (its episode ended, or its tool ran past
        ``release_after_s``)."""
        self.ops.append(Release(group_id, sample_index))

    def updated(self, version: int, params: object, *, recompute_cache: bool) -> None:
        """Records a weight update with prompts in flight, and keeps its weights."""
        self.ops.append(UpdateWeights(version, recompute_cache))
        self._weights[version] = params

    def weights(self) -> dict[int, object]:
        """``version -> params`` of every version a replay needs (none without a base).

        A version recorded twice maps to the weights recorded last.
        """
        return dict(self._weights) if self.base_version is not None else {}

    def state_dict(self) -> dict[str, object]:
        """JSON-able ``{"base_version": ..., "ops": [["s", group_id], ["d"],
        ["u", version, recompute_cache], ["r", group_id, sample_index, observation],
        ["x", group_id, sample_index], ...]}``; ``parse_ops`` reads the ops back."""
        return {"base_version": self.base_version, "ops": [op.to_json() for op in self.ops]}
