"""Multi-turn workloads from a trace: turns per episode, tool latency, observations.

A trace of multi-turn episodes holds one ``tool_call`` event per environment step
(written by ``rlaxkit.tasks.episodes.run_episodes`` and by the simulator), and, where the
writer knows them, per-turn token counts on ``generation_end`` (``turn_tokens``). From
them :func:`fit_turns` takes, as empirical distributions (tails included):

- ``turns``: the tool calls of each completed episode: the ``tool_call`` events of its
  actor and sample between its ``generation_start`` and ``generation_end``. A trace
  whose calls match no generation (``run_episodes`` alone writes no generation events)
  counts the calls of each sample id it names, so episodes that called no tool are
  missing from that count;
- ``tool_latency_s``: every call's ``duration_s``;
- ``observation_tokens``: every call's ``observation_tokens`` (0 where absent);
- ``response_tokens``: per policy turn (``turn_tokens``), not per episode.

It also gives, per completed episode, what the decode fit must take out of its latency
(:func:`sim.calibration.fits.fit_decode`): the seconds of its tool calls, and its policy
and observation tokens. The rest of an episode's time is modelled as one sequence's
decode, with the observations prefilled as prompt; a released slot's wait for a free
slot and its re-prefill of the whole context are not separated out (they are absent
when slots are held).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from rlaxkit.rules.trace import TraceEvent, generation_records
from sim.distributions import Constant, Distribution, Empirical

__all__ = ["TurnFit", "fit_turns"]

# (actor, sample) of one completed generation.
_Key = tuple[str, str]


@dataclass(frozen=True)
class TurnFit:
    """What a trace says about multi-turn episodes (see the module docstring).

    ``response_tokens`` is ``None`` when no ``generation_end`` gives per-turn tokens;
    ``adjust`` maps ``(actor, sample)`` of each completed episode that called a tool to
    ``(tool seconds, policy tokens, observation tokens)``.
    """

    turns: Distribution
    tool_latency_s: Distribution
    observation_tokens: Distribution
    response_tokens: Empirical | None
    adjust: dict[_Key, tuple[float, int, int]] = field(default_factory=dict)

    @property
    def multi_turn(self) -> bool:
        return self.turns.mean() > 0


def fit_turns(events: list[TraceEvent]) -> TurnFit:
    """Turns, tool latency and observation lengths of ``events`` (single-turn traces
    give zero turns and leave everything else as it was)."""
    calls = [e for e in events if e.kind == "tool_call"]
    per_turn = [
        int(tokens)
        for e in events
        if e.kind == "generation_end" and "turn_tokens" in e.fields
        for tokens in e["turn_tokens"]
    ]
    response = Empirical(values=tuple(per_turn)) if per_turn else None
    if not calls:
        zero = Constant(value=0.0)
        return TurnFit(zero, zero, zero, response)
    by_episode: dict[_Key, list[TraceEvent]] = defaultdict(list)
    for call in calls:
        by_episode[(call.actor, str(call["sample"]))].append(call)
    counts: list[int] = []
    adjust: dict[_Key, tuple[float, int, int]] = {}
    ends = {(e.actor, str(e["sample"]), e.t): e for e in events if e.kind == "generation_end"}
    for record in generation_records(events):
        key = (record.actor, record.sample)
        mine = [c for c in by_episode.get(key, ()) if record.start_s <= c.t <= record.end_s]
        counts.append(len(mine))
        if mine:
            end = ends.get((record.actor, record.sample, record.end_s))
            observed = sum(int(c.get("observation_tokens", 0)) for c in mine)
            policy = (
                sum(int(t) for t in end["turn_tokens"])
                if end is not None and "turn_tokens" in end.fields
                else record.tokens - observed
            )
            tool_s = sum(float(c["duration_s"]) for c in mine)
            adjust[key] = (tool_s, max(1, policy), observed)
    if not any(counts):  # no generation events around the calls: count by sample id
        per_sample: dict[str, int] = defaultdict(int)
        for call in calls:
            per_sample[str(call["sample"])] += 1
        counts = list(per_sample.values())
    return TurnFit(
        turns=Empirical(values=tuple(counts)),
        tool_latency_s=Empirical(values=tuple(float(c["duration_s"]) for c in calls)),
        observation_tokens=Empirical(
            values=tuple(float(c.get("observation_tokens", 0)) for c in calls)
        ),
        response_tokens=response,
        adjust=adjust,
    )
