"""What a calibration is asked to predict beyond what its run showed: fault kinds that
never fired, a fleet, slot count or trainer far from the calibrated size, and pulls in
flight whose cache rebuilds the run never measured."""

from __future__ import annotations

from collections.abc import Sequence

from rlaxkit.rules.trace import (
    TraceEvent,
)
from sim.calibration.host import MIN_REBUILDS
from sim.scenario import Scenario

# A fleet or trainer this many times larger (or smaller) than the calibrated one is
# named as an extrapolation: contention, collectives and the parameter server's egress
# were measured at the calibrated size only.
EXTRAPOLATION_FACTOR = 10.0


def extrapolations(
    events: Sequence[TraceEvent], fitted: Scenario, predicted: Scenario
) -> list[str]:
    """What a prediction assumes beyond its calibration run, one sentence each.

    Named: a fault kind the calibration trace never saw fire (its costs, such as restart
    and restore times, come from the scenario's assumptions, not a measurement), a
    fleet, slot count or trainer ``EXTRAPOLATION_FACTOR`` times the calibrated size or
    more (or as much smaller), and on the serial host pulls in flight when the trace
    rebuilt a worker's cache fewer than ``MIN_REBUILDS`` times (each rebuild is then
    charged as a prefill of every row, ``sim.calibration.host.fit_host``).
    """
    seen = {str(e["fault"]) for e in events if e.kind == "fault" and "fault" in e.fields}
    for event in events:
        if event.kind == "preemption":
            seen.add("preempt_trainer" if event.actor == "trainer" else "preempt_worker")
    wanted: set[str] = {fault.kind for fault in predicted.fault_plan}
    random_kinds = {
        "preempt_worker": predicted.preemptions.worker_mtbf_s,
        "preempt_slice": predicted.preemptions.slice_mtbf_s,
        "preempt_trainer": predicted.preemptions.trainer_mtbf_s,
    }
    wanted |= {kind for kind, mtbf in random_kinds.items() if mtbf is not None}
    out = [
        f"fault kind {kind!r} never fired in the calibration run; its costs (restart, "
        "restore, lost work) are the scenario's assumptions"
        for kind in sorted(wanted - seen)
    ]
    sizes = {
        "fleet.num_workers": (fitted.fleet.num_workers, predicted.fleet.num_workers),
        "fleet.slots_per_worker": (fitted.fleet.slots_per_worker, predicted.fleet.slots_per_worker),
        "trainer.chips": (fitted.trainer.chips, predicted.trainer.chips),
    }
    for name, (calibrated, asked) in sizes.items():
        ratio = asked / calibrated
        if ratio >= EXTRAPOLATION_FACTOR or ratio <= 1 / EXTRAPOLATION_FACTOR:
            out.append(
                f"{name} = {asked} predicted from a run with {calibrated} ({ratio:.3g}x); "
                "contention and transfer costs were measured at the calibrated size only"
            )
    rebuilds = sum(1 for e in events if e.kind == "pull" and e.get("rebuilt"))
    in_flight = predicted.weight_sync.pull_mode == "in_flight"
    if fitted.host.serial and in_flight and rebuilds < MIN_REBUILDS:
        out.append(
            f"the calibration run rebuilt a worker's KV cache {rebuilds} times (pulls in "
            "flight); the prediction pulls in flight and charges each rebuild as a prefill "
            "of every row, a lower bound; calibrate on a run with "
            "weight_sync.pull_mode=in_flight to measure them"
        )
    return out
