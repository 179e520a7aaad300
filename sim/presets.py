"""Scenario presets. Every number is either sourced (a bracketed key such as ``[R4]``,
listed with its source in ``docs/papers.md``) or marked as an assumption with the
reasoning behind it.

- :func:`toy`: a tiny deterministic fleet whose timings a test can work out by hand.
- :func:`rlax_like`: RLAX's setting, a v5p-512 trainer and a v5p inference fleet of
  128 to 1024 chips serving a 32B model, with preemptions.
- :func:`areal_like`: AReaL's sync-vs-async comparison at equal chips, under the
  long-tail response-time shape "99% of samples in 40 s, the last 1% 80 s more".
- :func:`local_runtime`: a few workers sharing one host with the trainer, the shape of
  rlaxkit's single-process local backend.
- :func:`checkpoint_study`: a trainer-bound run with exponential trainer preemptions,
  for choosing the checkpoint interval (Young/Daly).
- :func:`planned`: any of them with the trainer's FLOPs per token, the workers' decode
  cost and the push bytes taken from compiled programs (``rlaxkit.planning.plan``)
  instead of the assumptions above, which stay the fallback.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rlaxkit.rules.policies import CheckpointPolicy, PullMode, StalenessPolicy, WeightSyncPolicy
from sim.distributions import Constant, Lognormal, LongTail
from sim.plans import check_planned
from sim.scenario import Scenario, with_overrides, with_plan
from sim.specs import (
    CheckpointSpec,
    FleetSpec,
    ParamServerSpec,
    PreemptionSpec,
    TrainerCostSpec,
    VerifierSpec,
    WorkloadSpec,
)

__all__ = [
    "areal_like",
    "checkpoint_study",
    "from_plan",
    "local_runtime",
    "planned",
    "rlax_like",
    "toy",
]

HOUR_S = 3600.0

# --- hardware facts used by the presets -----------------------------------------------
V5P_PEAK_FLOPS = 459e12  # bf16 FLOP/s per TPU v5p chip (Google Cloud public spec sheet)
V5P_HBM_BYTES_PER_S = 2.76e12  # HBM bandwidth per v5p chip (same spec sheet)
QWQ_32B_PARAMS = 32.5e9  # QwQ-32B (RLAX's model [R1]) is a Qwen2.5-32B: ~32.5B parameters
# KV cache bytes per token of QwQ-32B: 64 layers x 8 KV heads x 128 dims x (K, V) x bf16.
QWQ_32B_KV_BYTES_PER_TOKEN = 64 * 8 * 128 * 2 * 2


def _apply(scenario: Scenario, overrides: Mapping[str, object]) -> Scenario:
    return with_overrides(scenario, overrides) if overrides else scenario


def toy(**overrides: object) -> Scenario:
    """One worker with 2 slots, groups of 2 samples of exactly 10 tokens, no noise.

    Hand timings: a sequence decodes in 10 × 0.1 s = 1 s after a 0.5 s prefill (5
    prompt tokens at 10 tokens/s); a reward takes 0.25 s; a step takes 2 s (40 tokens at
    20 tokens/s); a push takes 1 s; a pull takes 0.5 s. ``overrides`` are dotted paths
    (``{"staleness.max_staleness": 1}``) or ``target_steps``/``seed``.
    """
    scenario = Scenario(
        name="toy",
        trainer=TrainerCostSpec.from_rate(tokens_per_s=20.0, restart_s=5.0),
        fleet=FleetSpec(
            num_workers=1,
            slots_per_worker=2,
            decode_s_per_token=0.1,
            prefill_tokens_per_s=10.0,
            restart_s=3.0,
        ),
        param_server=ParamServerSpec(
            weight_bytes=100.0, push_bytes_per_s=100.0, pull_bytes_per_s=200.0
        ),
        verifier=VerifierSpec(latency_s=Constant(value=0.25)),
        workload=WorkloadSpec(
            prompts_per_step=1,
            group_size=2,
            prompt_tokens=Constant(value=5),
            response_tokens=Constant(value=10),
        ),
        staleness=StalenessPolicy(max_staleness=0, batch_size=1),
        target_steps=3,
    )
    return _apply(scenario, overrides)


def rlax_like(
    *,
    inference_chips: int = 1024,
    prompts_per_step: int = 256,
    max_staleness: int = 2,
    max_worker_lag: int = 0,
    pull_mode: PullMode = "between_requests",
    preemptions: bool = True,
    hours: float = 13.0,
    seed: int = 0,
) -> Scenario:
    """RLAX-like: QwQ-32B, a v5p-512 trainer, ``inference_chips`` v5p chips of workers.

    Sources (keys in ``docs/papers.md``) and assumptions:

    - Trainer fixed at v5p-512 and inference fleets of v5p-128 to v5p-1024 (RLAX Fig. 3
      [R4]). We read the fleet sizes as chip counts, as the abstract's "1024 v5p TPUs"
      does [R1] (Cloud TPU names count TensorCores, two per chip; halve them for the
      other reading). The trainer is 256 chips (v5p-512 = 256 chips).
    - Model QwQ-32B, 12 h 48 min run with preemptions [R1]: ``hours`` defaults to 13.
    - Staleness k = 1-2 does not hurt quality [R4]: η = 2. The inference reload bound
      [R3] is ``max_worker_lag``, 0 by default (a worker behind the newest published
      version pulls before its next request). Rollouts are single-version [R4], so pulls
      happen between requests.
    - The trainer's FLOPs per token, the decode cost and the push below are assumptions,
      the fallback when no plan was compiled: :func:`planned` replaces them with a
      compiled plan's (``rlaxkit plan configs/plan/qwen3_32b_v5p.yaml``).
    - Trainer MFU 0.35 (assumption: typical for 32B FSDP training on TPU); 8 FLOPs per
      token per parameter (6 for forward/backward plus 2 for the log-prob recompute
      RLAX does on the trainer [R4]).
    - Workers of 8 chips (assumption: TP=8 fits 65 GB of bf16 weights plus long KV
      caches in 8 × 95 GB HBM), 64 sequences each (assumption).
    - Decode time per token: the memory-bound roofline (weights, then KV reads of a
      12k-token mean context per running sequence, over 8 chips' HBM) divided by an
      efficiency of 0.6 (assumption).
    - 256 prompts × 16 samples per step (assumption; AReaL also uses 16 samples per
      prompt [A2]); completions lognormal with median 12k and p99 30k tokens, capped at
      32k (assumption for QwQ's long reasoning on Codeforces); prompts ~500 tokens.
    - Verifier on AWS Lambda [R2]: unlimited concurrency, latency median 5 s, p99 30 s
      (assumption).
    - Weight store with RDMA [R4]: 20 GB/s push, 10 GB/s per worker link, 400 GB/s
      egress, 1 s latency (assumptions; Marin moves 16 GB in 14 s over Arrow Flight
      [M1], a slower transport).
    - Preemptions (assumptions, RLAX gives no rates): each worker every 24 h, each
      4-worker slice every 48 h, the trainer every 12 h; workers restart in 5 min, the
      trainer in 340 s (Marin's trainer OOM restart took 5 min 40 s [M2]).
    - Checkpoints every 30 min (assumption; Tunix's minimum interval is 180 s [T3]),
      60 s to save, 120 s to restore, keep 3 (Tunix ``LatestN(n=3)`` [T3]).
    """
    chips_per_worker = 8
    efficiency = 0.6
    hbm = chips_per_worker * V5P_HBM_BYTES_PER_S
    weight_bytes = 2 * QWQ_32B_PARAMS
    context_tokens = 12_000
    trainer = TrainerCostSpec(
        chips=256,
        model_params=QWQ_32B_PARAMS,
        chip_flops=V5P_PEAK_FLOPS,
        mfu=0.35,
        step_overhead_s=2.0,
        restart_s=340.0,
    )
    fleet = FleetSpec(
        num_workers=inference_chips // chips_per_worker,
        chips_per_worker=chips_per_worker,
        slots_per_worker=64,
        decode_s_per_token=weight_bytes / hbm / efficiency,
        decode_s_per_token_per_seq=context_tokens * QWQ_32B_KV_BYTES_PER_TOKEN / hbm / efficiency,
        prefill_tokens_per_s=20_000.0,
        workers_per_slice=4,
        restart_s=300.0,
    )
    preempt = (
        PreemptionSpec(
            worker_mtbf_s=24 * HOUR_S, slice_mtbf_s=48 * HOUR_S, trainer_mtbf_s=12 * HOUR_S
        )
        if preemptions
        else PreemptionSpec()
    )
    return Scenario(
        name=f"rlax_like_{inference_chips}",
        trainer=trainer,
        fleet=fleet,
        param_server=ParamServerSpec(
            weight_bytes=weight_bytes,
            push_bytes_per_s=20e9,
            pull_bytes_per_s=10e9,
            total_bytes_per_s=400e9,
            latency_s=1.0,
        ),
        verifier=VerifierSpec(latency_s=Lognormal.from_median_p99(5.0, 30.0), timeout_s=300.0),
        checkpoint=CheckpointSpec(save_s=60.0, restore_s=120.0),
        workload=WorkloadSpec(
            prompts_per_step=prompts_per_step,
            group_size=16,
            prompt_tokens=Lognormal(median=500.0, sigma=0.3),
            response_tokens=Lognormal.from_median_p99(12_000.0, 30_000.0),
            max_response_tokens=32_768,
        ),
        staleness=StalenessPolicy(
            max_staleness=max_staleness, batch_size=prompts_per_step, max_worker_lag=max_worker_lag
        ),
        weight_sync=WeightSyncPolicy(push_every_steps=1, pull_mode=pull_mode),
        checkpointing=CheckpointPolicy(every_s=0.5 * HOUR_S, keep=3),
        preemptions=preempt,
        horizon_s=hours * HOUR_S,
        seed=seed,
    )


def areal_like(
    *,
    max_staleness: int = 4,
    target_steps: int = 20,
    pull_mode: PullMode = "in_flight",
    seed: int = 0,
) -> Scenario:
    """AReaL-like: the same chips run sync (η = 0) or async (η ≥ 1); long-tail lengths.

    Sources (keys in ``docs/papers.md``) and assumptions:

    - Long tail: 99% of samples finish within ~40 s, the last 1% need ~80 s more
      (Applied Compute, Qwen-30B [AC2]); :meth:`LongTail.from_latency` turns this into
      tokens at the fleet's per-token time.
    - Rollout is > 70% of a synchronous step (ROLL Flash [RO2]): the trainer here takes
      ~40% of the fleet's time per batch (assumption), so sync spends most of its step
      generating.
    - Equal chips: sync and async share one disaggregated fleet and trainer; only η
      changes (AReaL's η = ``max_head_offpolicyness``, η = 0 synchronous [A4]).
    - Interruptible rollout: workers reload weights in flight [A2].
    - Fleet and batch scaled down to keep runs fast (assumption): 4 workers × 16
      sequences, 16 prompts × 8 samples per step (two waves of the fleet per step).
    """
    seconds_per_token = 0.02
    lengths = LongTail.from_latency(
        p99_s=40.0, tail_extra_s=80.0, seconds_per_token=seconds_per_token
    )
    slots = 4 * 16
    samples_per_step = 16 * 8
    gen_s_per_step = samples_per_step * lengths.mean() * seconds_per_token / slots
    tokens_per_step = samples_per_step * (lengths.mean() + 200)
    return Scenario(
        name=f"areal_like_eta{max_staleness}",
        trainer=TrainerCostSpec.from_rate(tokens_per_s=tokens_per_step / (0.4 * gen_s_per_step)),
        fleet=FleetSpec(
            num_workers=4,
            slots_per_worker=16,
            decode_s_per_token=seconds_per_token,
            prefill_tokens_per_s=10_000.0,
        ),
        param_server=ParamServerSpec(
            weight_bytes=3e9, push_bytes_per_s=10e9, pull_bytes_per_s=10e9
        ),
        verifier=VerifierSpec(latency_s=Constant(value=1.0)),
        workload=WorkloadSpec(
            prompts_per_step=16,
            group_size=8,
            prompt_tokens=Constant(value=200),
            response_tokens=lengths,
        ),
        staleness=StalenessPolicy(max_staleness=max_staleness, batch_size=16),
        weight_sync=WeightSyncPolicy(push_every_steps=1, pull_mode=pull_mode),
        target_steps=target_steps,
        horizon_s=1000 * HOUR_S,
        seed=seed,
    )


def local_runtime(
    *,
    num_workers: int = 2,
    max_staleness: int = 1,
    target_steps: int = 20,
    pauses_fleet: bool = True,
    seed: int = 0,
) -> Scenario:
    """rlaxkit's local backend: a tiny model, a few workers and the trainer on one host.

    All numbers are assumptions of a CPU run of a small model; :func:`sim.calibrate`
    replaces them with values fitted from a real local trace. Workers share the host,
    so per-token time grows with the sequences decoding fleet-wide
    (``occupancy_scope="host"``), and in the deterministic mode a train step pauses the
    decoders (``pauses_fleet``).
    """
    return Scenario(
        name="local_runtime",
        trainer=TrainerCostSpec.from_rate(
            tokens_per_s=4000.0, step_overhead_s=0.2, restart_s=1.0, pauses_fleet=pauses_fleet
        ),
        fleet=FleetSpec(
            num_workers=num_workers,
            slots_per_worker=4,
            decode_s_per_token=0.004,
            decode_s_per_token_per_seq=0.001,
            prefill_tokens_per_s=2000.0,
            occupancy_scope="host",
            restart_s=1.0,
        ),
        param_server=ParamServerSpec(
            weight_bytes=4e6, push_bytes_per_s=1e9, pull_bytes_per_s=1e9, latency_s=0.01
        ),
        verifier=VerifierSpec(latency_s=Lognormal(median=0.002, sigma=0.3)),
        workload=WorkloadSpec(
            prompts_per_step=4,
            group_size=4,
            prompt_tokens=Lognormal(median=24.0, sigma=0.2),
            response_tokens=Lognormal(median=48.0, sigma=0.5),
            max_response_tokens=128,
        ),
        staleness=StalenessPolicy(max_staleness=max_staleness, batch_size=4),
        target_steps=target_steps,
        horizon_s=24 * HOUR_S,
        seed=seed,
    )


def checkpoint_study(
    *,
    every_steps: int = 5,
    save_s: float = 60.0,
    mtbf_s: float = HOUR_S,
    step_s: float = 120.0,
    horizon_s: float = 200 * HOUR_S,
    seed: int = 0,
) -> Scenario:
    """A trainer-bound run (data always ready) with exponential trainer preemptions.

    The fleet is made fast enough never to be the bottleneck, so the time lost is that
    of checkpoint saves, re-done steps and restarts, the quantities of Young's and
    Daly's optimum interval ``sqrt(2 · save_s · MTBF)``. Numbers are assumptions chosen
    so the optimum (~657 s, between 5 and 6 steps of 120 s) sits inside a sweep of
    ``every_steps``; restarts take 60 s and restores 60 s.
    """
    return Scenario(
        name=f"checkpoint_every_{every_steps}",
        trainer=TrainerCostSpec.from_rate(tokens_per_s=2.0 / step_s, restart_s=60.0),
        fleet=FleetSpec(num_workers=1, slots_per_worker=4, decode_s_per_token=0.01),
        param_server=ParamServerSpec(weight_bytes=0.0, push_bytes_per_s=1.0, pull_bytes_per_s=1.0),
        checkpoint=CheckpointSpec(save_s=save_s, restore_s=60.0),
        workload=WorkloadSpec(
            prompts_per_step=1,
            group_size=1,
            prompt_tokens=Constant(value=1),
            response_tokens=Constant(value=1),
        ),
        staleness=StalenessPolicy(max_staleness=1, batch_size=1),
        checkpointing=CheckpointPolicy(every_steps=every_steps),
        preemptions=PreemptionSpec(trainer_mtbf_s=mtbf_s),
        horizon_s=horizon_s,
        seed=seed,
    )


def planned(base: Scenario, compiled: Mapping[str, object]) -> Scenario:
    """``base`` with the costs a compiled plan gives (``Plan.sim_overrides()``).

    The trainer's step time then follows from the FLOPs XLA counted for the real train
    step (``flops_per_token_factor``, with the plan's chips, chip peak and MFU), the
    workers' per-token time from the bytes the real decode step moves over HBM, and the
    push from the weights' bytes; every other number stays ``base``'s. The name gets
    ``_planned``, so a report tells compiled rates from the presets' assumed ones.

    >>> s = planned(toy(), {"trainer.flops_per_token_factor": 2.0})
    >>> s.name, s.trainer.step_s(40.0)   # twice the FLOPs per token: twice the 2 s step
    ('toy_planned', 4.0)

    Raises:
        ValueError: a key that is not one of ``sim.plans.PLANNED_FIELDS``.
    """
    scenario = with_overrides(base, check_planned(compiled))
    return with_overrides(scenario, {"name": f"{base.name}_planned"})


def from_plan(plan: str | Path | Mapping[str, Any], base: Scenario | None = None) -> Scenario:
    """``base`` (default :func:`rlax_like`) with the costs of a compiled plan.

    ``plan`` is a plan's summary (``rlaxkit plan --json``, ``Plan.summary()``), the path
    of one stored as JSON, or the path of a plan YAML whose ``.plan.json`` sits beside
    it. Its ``sim_overrides`` set the trainer's step time, the workers' shape, per-step
    decode time per slot and prefill rate, the push bytes and, with ``total_chips``, the
    number of workers (:func:`planned`). From an XLA:TPU plan the times are the TPU
    compiler's estimates; from an XLA:CPU one, the MFU and HBM efficiency it assumed (the
    labelled fallback): the name ends in ``_planned_tpu`` or ``_planned_cpu``. Reading a
    stored plan compiles nothing.

    Raises:
        ValueError: a YAML whose plan was never stored (the message gives the command),
            or a summary without ``sim_overrides``.
    """
    return with_plan(rlax_like() if base is None else base, plan)
