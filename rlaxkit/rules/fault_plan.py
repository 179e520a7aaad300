"""FaultPlan: the one format for injected faults, shared by the runtime and the simulator.

A plan is a list of faults, each fired at a time (``at_s``, seconds since run start) or
after a trainer step (``at_step``). On disk it is YAML or JSON, either a bare list or a
mapping with a ``faults`` key:

.. code-block:: yaml

    faults:
      - {kind: preempt_worker, target: worker-3, at_s: 600, restart_after_s: 120}
      - {kind: preempt_slice, target: slice-0, at_s: 1800}
      - {kind: preempt_trainer, at_step: 40, restart_after_s: 300}
      - {kind: kill_param_server, at_s: 900, restart_after_s: 30}
      - {kind: slow_worker, target: worker-1, at_s: 100, factor: 3.0, duration_s: 600}
      - {kind: fail_pull, target: worker-2, at_step: 5, count: 2}
      - {kind: hang_reward, at_s: 50}

Fault kinds and their fields:

- ``preempt_worker`` (``target``: worker name) and ``preempt_slice`` (``target``: slice
  name; every worker of the slice goes down together, a correlated preemption): the
  accelerators are reclaimed; work in flight there is lost; back after
  ``restart_after_s`` (``None``: the consumer's default restart delay).
- ``preempt_trainer``: the trainer loses the work since its last checkpoint and restores
  after ``restart_after_s``.
- ``kill_param_server``: the weight store is unreachable for ``restart_after_s``; its
  versions are persistent (RLAX backs it with TensorStore), so nothing is lost.
- ``slow_worker``: ``target`` runs ``factor`` times slower for ``duration_s``.
- ``fail_pull``: the next ``count`` weight pulls of ``target`` (``None``: any worker)
  fail and are retried.
- ``hang_reward``: the next ``count`` reward calls hang until the reward timeout.

Random plans come from :func:`random_preemptions` (exponential or Weibull
inter-arrival times, seeded), one renewal process per target.
"""

from __future__ import annotations

import json
import math
import os
import random
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Literal, get_args

import yaml

from rlaxkit.rules.validation import check_int, is_number

__all__ = [
    "Fault",
    "FaultKind",
    "FaultPlan",
    "InterArrival",
    "random_preemptions",
]

FaultKind = Literal[
    "preempt_worker",
    "preempt_slice",
    "preempt_trainer",
    "kill_param_server",
    "slow_worker",
    "fail_pull",
    "hang_reward",
]
InterArrival = Literal["exponential", "weibull"]

_NEEDS_TARGET = {"preempt_worker", "preempt_slice", "slow_worker"}
_HAS_RESTART = {"preempt_worker", "preempt_slice", "preempt_trainer", "kill_param_server"}
_DEFAULT_TARGET = {"preempt_trainer": "trainer", "kill_param_server": "param_server"}


def _is_number(value: object) -> bool:
    return is_number(value) and math.isfinite(value)


@dataclass(frozen=True, kw_only=True)
class Fault:
    """One injected fault (see the module docstring for kinds and fields).

    Exactly one of ``at_s`` and ``at_step`` is set. ``where`` in error messages is the
    fault's position in its plan (``faults[3]``).
    """

    kind: FaultKind
    at_s: float | None = None
    at_step: int | None = None
    target: str | None = None
    restart_after_s: float | None = None
    factor: float | None = None
    duration_s: float | None = None
    count: int = 1

    def __post_init__(self) -> None:
        self.validate("fault")

    def validate(self, where: str) -> None:
        """Raise ``ValueError`` naming ``where.field`` for the first bad field."""
        if self.kind not in get_args(FaultKind):
            raise ValueError(
                f"{where}.kind: must be one of {get_args(FaultKind)}, got {self.kind!r}"
            )
        if (self.at_s is None) == (self.at_step is None):
            raise ValueError(f"{where}.at_s: set exactly one of at_s and at_step")
        if self.at_s is not None and (not _is_number(self.at_s) or self.at_s < 0):
            raise ValueError(f"{where}.at_s: must be a number >= 0, got {self.at_s!r}")
        if self.at_step is not None:
            check_int(f"{where}.at_step", self.at_step, minimum=0)
        if self.kind in _NEEDS_TARGET and not self.target:
            raise ValueError(f"{where}.target: required for kind {self.kind!r}")
        if self.target is not None and (not isinstance(self.target, str) or not self.target):
            raise ValueError(f"{where}.target: must be a non-empty string, got {self.target!r}")
        if self.restart_after_s is not None:
            if self.kind not in _HAS_RESTART:
                raise ValueError(f"{where}.restart_after_s: only for kinds {sorted(_HAS_RESTART)}")
            if not _is_number(self.restart_after_s) or self.restart_after_s < 0:
                raise ValueError(
                    f"{where}.restart_after_s: must be a number >= 0, got {self.restart_after_s!r}"
                )
        if self.kind == "slow_worker":
            if self.factor is None or not _is_number(self.factor) or self.factor < 1:
                raise ValueError(f"{where}.factor: must be a number >= 1, got {self.factor!r}")
            if self.duration_s is None or not _is_number(self.duration_s) or self.duration_s <= 0:
                raise ValueError(
                    f"{where}.duration_s: must be a number > 0, got {self.duration_s!r}"
                )
        else:
            if self.factor is not None:
                raise ValueError(f"{where}.factor: only for kind 'slow_worker'")
            if self.duration_s is not None:
                raise ValueError(f"{where}.duration_s: only for kind 'slow_worker'")
        check_int(f"{where}.count", self.count, minimum=1)

    @property
    def resolved_target(self) -> str | None:
        """``target``, or the fixed actor of trainer and parameter-server faults."""
        return self.target if self.target is not None else _DEFAULT_TARGET.get(self.kind)

    def to_dict(self) -> dict[str, object]:
        """The fields that are set (defaults left out), ready for YAML/JSON."""
        out: dict[str, Any] = {"kind": self.kind}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name != "kind" and value is not None and not (f.name == "count" and value == 1):
                out[f.name] = value
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, where: str = "fault") -> Fault:
        """Parse one fault; unknown keys and bad values raise naming ``where.field``."""
        if not isinstance(data, Mapping):
            raise ValueError(f"{where}: must be a mapping, got {type(data).__name__}")
        allowed = {f.name for f in fields(cls)}
        for key in data:
            if key not in allowed:
                raise ValueError(f"{where}.{key}: unknown field; allowed: {sorted(allowed)}")
        if "kind" not in data:
            raise ValueError(f"{where}.kind: required")
        values = dict(data)
        for key in ("at_s", "restart_after_s", "factor", "duration_s"):
            if _is_number(values.get(key)):
                values[key] = float(values[key])
        try:
            return cls(**values)
        except ValueError as error:
            raise ValueError(str(error).replace("fault.", f"{where}.", 1)) from None


@dataclass(frozen=True)
class FaultPlan:
    """An ordered collection of :class:`Fault`; empty means no injected faults."""

    faults: tuple[Fault, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "faults", tuple(self.faults))
        for index, fault in enumerate(self.faults):
            if not isinstance(fault, Fault):
                raise ValueError(f"faults[{index}]: must be a Fault, got {type(fault).__name__}")
            fault.validate(f"faults[{index}]")

    def __len__(self) -> int:
        return len(self.faults)

    def __iter__(self) -> Iterator[Fault]:
        return iter(self.faults)

    def timed(self) -> list[Fault]:
        """Faults with ``at_s``, in firing order (stable for equal times)."""
        timed = [(f.at_s, f) for f in self.faults if f.at_s is not None]
        return [f for _, f in sorted(timed, key=lambda pair: pair[0])]

    def by_step(self) -> dict[int, list[Fault]]:
        """Faults with ``at_step``, grouped by the step after which they fire."""
        out: dict[int, list[Fault]] = {}
        for fault in self.faults:
            if fault.at_step is not None:
                out.setdefault(fault.at_step, []).append(fault)
        return out

    def merged(self, *others: FaultPlan) -> FaultPlan:
        """This plan's faults followed by the others'."""
        combined = list(self.faults)
        for other in others:
            combined.extend(other.faults)
        return FaultPlan(tuple(combined))

    def to_dicts(self) -> list[dict[str, object]]:
        """List of plain dicts (see :meth:`Fault.to_dict`)."""
        return [fault.to_dict() for fault in self.faults]

    @classmethod
    def from_dicts(cls, items: Iterable[Mapping[str, Any]] | Mapping[str, Any]) -> FaultPlan:
        """Parse a list of fault mappings, or a mapping ``{"faults": [...]}``."""
        entries: object = items
        if isinstance(items, Mapping):
            extra = set(items) - {"faults"}
            if extra:
                raise ValueError(f"{sorted(extra)[0]}: unknown key; a plan has only 'faults'")
            entries = items.get("faults") or []
        if isinstance(entries, str | bytes) or not isinstance(entries, Iterable):
            raise ValueError(f"faults: must be a list, got {type(entries).__name__}")
        return cls(
            tuple(Fault.from_dict(item, where=f"faults[{i}]") for i, item in enumerate(entries))
        )

    @classmethod
    def load(cls, path: str | os.PathLike) -> FaultPlan:
        """Read a plan from ``.json``, ``.yaml`` or ``.yml``."""
        path = Path(path)
        text = path.read_text(encoding="utf-8")
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
        return cls.from_dicts(data or [])

    def save(self, path: str | os.PathLike) -> None:
        """Write the plan as ``{"faults": [...]}``; JSON for ``.json``, else YAML."""
        path = Path(path)
        data = {"faults": self.to_dicts()}
        if path.suffix == ".json":
            path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
        else:
            path.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")


def random_preemptions(
    *,
    targets: Sequence[str],
    horizon_s: float,
    mtbf_s: float,
    kind: FaultKind = "preempt_worker",
    distribution: InterArrival = "exponential",
    weibull_shape: float = 1.0,
    restart_after_s: float | None = None,
    seed: int = 0,
) -> FaultPlan:
    """Seeded random preemptions of each target over ``[0, horizon_s)``.

    Each target is an independent renewal process on wall time: the gap between its
    preemptions is exponential with mean ``mtbf_s``, or Weibull with shape
    ``weibull_shape`` and scale ``mtbf_s / Γ(1 + 1/shape)`` (so its mean is also
    ``mtbf_s``; shape < 1 gives bursty failures, > 1 wear-out). A preemption drawn
    while the target is still down is the consumer's to resolve (the simulator restarts
    the downtime).

    Args:
        targets: Actor names (``worker-0``, ``slice-2``, ``trainer``).
        horizon_s: End of the generated window, in seconds.
        mtbf_s: Mean time between preemptions of one target, in seconds.
        kind: ``preempt_worker``, ``preempt_slice`` or ``preempt_trainer``.
        distribution: ``exponential`` or ``weibull``.
        weibull_shape: Weibull shape parameter k (> 0).
        restart_after_s: Downtime written into every fault (``None``: consumer default).
        seed: Seed of the plan's random stream; the same seed gives the same plan.
    """
    if kind not in {"preempt_worker", "preempt_slice", "preempt_trainer"}:
        raise ValueError(f"kind: must be a preemption kind, got {kind!r}")
    if distribution not in get_args(InterArrival):
        raise ValueError(
            f"distribution: must be one of {get_args(InterArrival)}, got {distribution!r}"
        )
    if not _is_number(mtbf_s) or mtbf_s <= 0:
        raise ValueError(f"mtbf_s: must be a number > 0, got {mtbf_s!r}")
    if not _is_number(horizon_s) or horizon_s < 0:
        raise ValueError(f"horizon_s: must be a number >= 0, got {horizon_s!r}")
    if not _is_number(weibull_shape) or weibull_shape <= 0:
        raise ValueError(f"weibull_shape: must be a number > 0, got {weibull_shape!r}")
    rng = random.Random(f"faults-{seed}-{kind}")
    scale = mtbf_s / math.gamma(1.0 + 1.0 / weibull_shape)
    faults: list[tuple[float, Fault]] = []  # (at_s, fault)
    for target in targets:
        t = 0.0
        while True:
            if distribution == "exponential":
                t += rng.expovariate(1.0 / mtbf_s)
            else:
                t += rng.weibullvariate(scale, weibull_shape)
            if t >= horizon_s:
                break
            fault = Fault(
                kind=kind,
                at_s=t,
                target=None if kind == "preempt_trainer" else target,
                restart_after_s=restart_after_s,
            )
            faults.append((t, fault))
    faults.sort(key=lambda pair: pair[0])
    return FaultPlan(tuple(fault for _, fault in faults))
