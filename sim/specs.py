"""Specs of the simulated entities and their time models (all times in seconds).

Each spec is a frozen, validated dataclass; its methods are the closed-form time models
the SimPy processes use, so a test can compute by hand what the simulator must do:

- trainer step: ``step_overhead_s + tokens / tokens_per_s`` with
  ``tokens_per_s = chips · chip_flops · mfu / (flops_per_token_factor · model_params)``;
- decode: a sequence costs ``prompt_tokens / prefill_tokens_per_s`` to prefill, then
  ``decode_s_per_token + decode_s_per_token_per_seq · (occupancy - 1)`` per token,
  ``occupancy`` being the sequences decoding on the worker (or on the shared host)
  when it starts: continuous batching makes each step slower as the batch grows;
- multi-turn episode (``WorkloadSpec.turns`` > 0): per policy turn the decode above,
  per tool call a ``tool_latency_s`` draw with the slot held (up to
  ``FleetSpec.release_after_s``), then a prefill of the observation (held) or of the
  whole context (released, or new weights);
- weight push: ``latency_s + weight_bytes / push_bytes_per_s``; a pull gets
  ``min(pull_bytes_per_s, total_bytes_per_s / n)`` while ``n`` pulls share the store
  (processor sharing), after ``latency_s``;
- serial host (``HostSpec.executor="serial"``, rlaxkit's deterministic local runtime):
  a decode chunk costs ``chunk_s + chunk_s_per_step · steps + prefill_s_per_seq ·
  started + finish_s_per_seq · finished``, scoring ``score_s + score_s_per_seq ·
  sequences``, plus host time per round, issued sequence, chunk, scored sequence and
  train step (see ``sim.host_spec.HostSpec``); nothing overlaps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from rlaxkit.rules.fault_plan import InterArrival
from rlaxkit.rules.validation import is_int, is_number
from sim.distributions import Constant, Distribution

__all__ = [
    "CheckpointSpec",
    "Executor",
    "FleetSpec",
    "OccupancyScope",
    "ParamServerSpec",
    "PreemptionSpec",
    "TrainerCostSpec",
    "VerifierSpec",
    "WorkloadSpec",
]

OccupancyScope = Literal["worker", "host"]
Executor = Literal["parallel", "serial"]


def check_field(
    name: str,
    value: Any,
    *,
    low: float = 0.0,
    strict: bool = True,
    integer: bool = False,
    finite: bool = False,
) -> None:
    bad_type = not (is_int(value) if integer else is_number(value))
    if (
        bad_type
        or math.isnan(value)
        or (value <= low if strict else value < low)
        or (finite and math.isinf(value))
    ):
        noun = "integer" if integer else "number"
        kind = f"a finite {noun}" if finite else ("an integer" if integer else "a number")
        raise ValueError(f"{name}: must be {kind} {'>' if strict else '>='} {low}, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class TrainerCostSpec:
    """The trainer's chips and throughput.

    Attributes:
        chips: Accelerator chips of the trainer.
        model_params: Parameters of the policy model.
        chip_flops: Peak FLOP/s of one chip (bf16).
        mfu: Model FLOPs utilisation reached by the train step (0-1].
        flops_per_token_factor: FLOPs per token per parameter: 6 for forward + backward,
            plus 2 for the log-prob recomputation RLAX and AReaL do on the trainer.
        step_overhead_s: Fixed cost per step (optimizer, host, collectives).
        restart_s: Downtime after a preemption before the restore starts.
        pauses_fleet: The trainer and the workers share one device, so a train step
            pauses every decode (KV caches kept); rlaxkit's deterministic local backend
            interleaves them this way.
    """

    chips: int
    model_params: float
    chip_flops: float
    mfu: float
    flops_per_token_factor: float = 8.0
    step_overhead_s: float = 0.0
    restart_s: float = 300.0
    pauses_fleet: bool = False

    def __post_init__(self) -> None:
        check_field("chips", self.chips, integer=True)
        # Infinite costs make an infinite step: SimPy cannot schedule it.
        check_field("model_params", self.model_params, finite=True)
        check_field("chip_flops", self.chip_flops)
        check_field("mfu", self.mfu)
        if self.mfu > 1:
            raise ValueError(f"mfu: must be in (0, 1], got {self.mfu!r}")
        check_field("flops_per_token_factor", self.flops_per_token_factor, finite=True)
        check_field("step_overhead_s", self.step_overhead_s, strict=False, finite=True)
        check_field("restart_s", self.restart_s, strict=False, finite=True)

    @classmethod
    def from_rate(
        cls,
        *,
        tokens_per_s: float,
        step_overhead_s: float = 0.0,
        restart_s: float = 300.0,
        pauses_fleet: bool = False,
    ) -> TrainerCostSpec:
        """A trainer described only by its measured tokens/s (one abstract chip)."""
        return cls(
            pauses_fleet=pauses_fleet,
            chips=1,
            model_params=1.0,
            chip_flops=float(tokens_per_s),
            mfu=1.0,
            flops_per_token_factor=1.0,
            step_overhead_s=step_overhead_s,
            restart_s=restart_s,
        )

    @property
    def tokens_per_s(self) -> float:
        """Trained tokens per second: ``chips·chip_flops·mfu / (factor·model_params)``."""
        return (
            self.chips
            * self.chip_flops
            * self.mfu
            / (self.flops_per_token_factor * self.model_params)
        )

    def step_s(self, tokens: float) -> float:
        """Seconds of compute for one step over ``tokens`` (prompt + completion)."""
        return self.step_overhead_s + tokens / self.tokens_per_s


@dataclass(frozen=True, kw_only=True)
class FleetSpec:
    """The inference fleet: identical workers with continuous batching.

    Attributes:
        num_workers: Inference workers (each a group of chips serving one model copy).
        chips_per_worker: Chips per worker (for chip accounting only).
        slots_per_worker: Sequences a worker decodes at once.
        decode_s_per_token: Seconds per decoded token with one sequence running.
        decode_s_per_token_per_seq: Extra seconds per token for each further running
            sequence (KV-cache reads grow with the batch).
        prefill_tokens_per_s: Prompt tokens prefilled per second for one sequence.
        workers_per_slice: Workers that share a slice and are preempted together.
        occupancy_scope: ``worker``: a sequence slows with its worker's load; ``host``:
            all workers share one host (a single-process local runtime) and a sequence
            slows with the whole fleet's load.
        restart_s: Downtime after a preemption, before the worker pulls weights again.
        pull_retry_s: Wait before retrying a failed weight pull.
        release_after_s: Multi-turn episodes (``WorkloadSpec.turns``): a slot whose
            episode waits for a tool holds its row and KV cache (the engine's
            ``submit(hold=True)``) for at most this many seconds; a tool that takes
            longer has the slot released to other work at that point, and the episode
            re-prefills its whole context when it comes back (``None``: always held).
        kv_pool_tokens: A paged KV cache of this many token slots per worker: a worker
            decodes as many rows as the pages hold at the workload's lengths
            (``rlaxkit.rules.paging.rows_that_fit``, the engine's admission rule), at most
            ``slots_per_worker``. ``None``: a dense cache, ``slots_per_worker`` rows.
        page_size: Token slots per page of the paged cache.
    """

    num_workers: int
    slots_per_worker: int
    decode_s_per_token: float
    decode_s_per_token_per_seq: float = 0.0
    prefill_tokens_per_s: float = math.inf
    chips_per_worker: int = 1
    workers_per_slice: int = 1
    occupancy_scope: OccupancyScope = "worker"
    restart_s: float = 120.0
    pull_retry_s: float = 5.0
    release_after_s: float | None = None
    kv_pool_tokens: int | None = None
    page_size: int = 16

    def __post_init__(self) -> None:
        check_field("num_workers", self.num_workers, integer=True)
        check_field("page_size", self.page_size, integer=True)
        if self.kv_pool_tokens is not None:
            check_field("kv_pool_tokens", self.kv_pool_tokens, integer=True)
        check_field("slots_per_worker", self.slots_per_worker, integer=True)
        check_field("decode_s_per_token", self.decode_s_per_token)
        check_field("decode_s_per_token_per_seq", self.decode_s_per_token_per_seq, strict=False)
        check_field("prefill_tokens_per_s", self.prefill_tokens_per_s)
        check_field("chips_per_worker", self.chips_per_worker, integer=True)
        check_field("workers_per_slice", self.workers_per_slice, integer=True)
        if self.occupancy_scope not in get_args(OccupancyScope):
            raise ValueError(
                f"occupancy_scope: must be one of {get_args(OccupancyScope)}, "
                f"got {self.occupancy_scope!r}"
            )
        check_field("restart_s", self.restart_s, strict=False)
        check_field("pull_retry_s", self.pull_retry_s, strict=False)
        if self.release_after_s is not None:
            check_field("release_after_s", self.release_after_s, strict=False)

    @property
    def chips(self) -> int:
        """Chips of the whole fleet."""
        return self.num_workers * self.chips_per_worker

    @property
    def num_slices(self) -> int:
        """Slices (groups of workers preempted together)."""
        return -(-self.num_workers // self.workers_per_slice)

    def per_token_s(self, occupancy: int) -> float:
        """Seconds per decoded token while ``occupancy`` sequences run."""
        return self.decode_s_per_token + self.decode_s_per_token_per_seq * max(0, occupancy - 1)

    def prefill_s(self, tokens: float) -> float:
        """Seconds to prefill ``tokens`` prompt (or recomputed) tokens."""
        return tokens / self.prefill_tokens_per_s


@dataclass(frozen=True, kw_only=True)
class ParamServerSpec:
    """The versioned weight store between the trainer and the fleet.

    Attributes:
        weight_bytes: Bytes of one weight version (bf16: 2 bytes per parameter).
        push_bytes_per_s: Trainer-to-store bandwidth.
        pull_bytes_per_s: Store-to-worker bandwidth of one worker's link.
        total_bytes_per_s: Egress of the store shared by concurrent pulls (``None``:
            unlimited, each pull gets its link rate).
        latency_s: Fixed cost per push or pull (RPC setup, resharding).
        restart_s: Downtime after the store is killed.
        delta_changed_fraction: ``None`` publishes every version whole; a fraction ``f``
            in [0, 1] publishes deltas (``rlaxkit.param_server.DeltaParameterServer``),
            one version's delta moving ``f`` of the bytes (see ``SimParameterServer``;
            ``benchmarks/weight_delta.py`` measured 0.50 for float32 weights and 0.087
            rounded to bfloat16 after a real GRPO step).
        snapshot_every: With deltas, every this many pushes is a full snapshot.
        adapter_fraction: ``None``, or a LoRA run's adapter bytes as a fraction ``a`` of
            ``weight_bytes``: the base is published once and every push moves the
            adapters (``rlaxkit.param_server.AdapterParameterServer``; see
            ``SimParameterServer``; ``benchmarks/weight_lora.py``: 0.029 at rank 8 on its
            128-wide bench model, 0.0089 for Qwen2.5-0.5B). Not with deltas.
    """

    weight_bytes: float
    push_bytes_per_s: float
    pull_bytes_per_s: float
    total_bytes_per_s: float | None = None
    latency_s: float = 0.0
    restart_s: float = 30.0
    delta_changed_fraction: float | None = None
    snapshot_every: int = 4
    adapter_fraction: float | None = None

    def __post_init__(self) -> None:
        check_field("weight_bytes", self.weight_bytes, strict=False)
        check_field("push_bytes_per_s", self.push_bytes_per_s)
        check_field("pull_bytes_per_s", self.pull_bytes_per_s)
        if self.total_bytes_per_s is not None:
            check_field("total_bytes_per_s", self.total_bytes_per_s)
        check_field("latency_s", self.latency_s, strict=False)
        check_field("restart_s", self.restart_s, strict=False)
        if self.delta_changed_fraction is not None:
            check_field("delta_changed_fraction", self.delta_changed_fraction, strict=False)
            if self.delta_changed_fraction > 1:
                raise ValueError(
                    "delta_changed_fraction: must be a fraction in [0, 1] (or None: no "
                    f"deltas), got {self.delta_changed_fraction!r}"
                )
        check_field("snapshot_every", self.snapshot_every, low=1, strict=False, integer=True)
        if self.adapter_fraction is not None:
            check_field("adapter_fraction", self.adapter_fraction, strict=False)
            if self.adapter_fraction > 1 or self.delta_changed_fraction is not None:
                raise ValueError(
                    "adapter_fraction: must be a fraction in [0, 1] and leaves "
                    f"delta_changed_fraction unset, got {self.adapter_fraction!r} with "
                    f"delta_changed_fraction={self.delta_changed_fraction!r}"
                )

    def push_s(self, nbytes: float | None = None) -> float:
        """Seconds for the trainer to push ``nbytes`` (default: one whole version)."""
        nbytes = self.weight_bytes if nbytes is None else nbytes
        return self.latency_s + nbytes / self.push_bytes_per_s

    def pull_rate(self, concurrent: int) -> float:
        """Bytes/s one pull gets while ``concurrent`` pulls share the store."""
        if self.total_bytes_per_s is None:
            return self.pull_bytes_per_s
        return min(self.pull_bytes_per_s, self.total_bytes_per_s / max(1, concurrent))


@dataclass(frozen=True, kw_only=True)
class VerifierSpec:
    """The reward service: latency per scored sample, concurrency, and timeout.

    Attributes:
        latency_s: Distribution of the seconds to score one sample.
        concurrency: Samples scored at once (``None``: unlimited, e.g. AWS Lambda).
        timeout_s: A hung reward call is abandoned after this many seconds and its
            group dropped (reason ``reward_timeout``).
    """

    latency_s: Distribution = field(default_factory=lambda: Constant(value=0.0))
    concurrency: int | None = None
    timeout_s: float = 300.0

    def __post_init__(self) -> None:
        if self.concurrency is not None:
            check_field("concurrency", self.concurrency, integer=True)
        check_field("timeout_s", self.timeout_s)


@dataclass(frozen=True, kw_only=True)
class CheckpointSpec:
    """Costs of the trainer's checkpoints.

    Attributes:
        save_s: Seconds a save blocks the trainer (an asynchronous save: until its
            arrays are copied; the checkpoint counts from then on).
        background_s: Seconds of the trainer host's time an asynchronous save's
            background write takes after that. The write competes with the work
            beside it for the host's cores (wholly on a process's CPU clock, where
            every thread's time adds up): over ``write_s`` seconds it takes the share
            ``background_s / write_s`` of them, and the trainer's work (on a serial
            host, all of the host's) runs that much slower (``sim.entities.trainer.
            CheckpointWrites``). A ``checkpoint_write`` event marks its end, as the
            runtime's does. A preemption during it keeps the checkpoint (the
            runtime's restore waits for the write), and the next save starts once it
            is done (as Orbax's does).
        write_s: Seconds from a save's return to its write being durable. ``0``, or no
            more than ``background_s``: the write leaves no time to other work, and
            the trainer waits ``background_s`` after the blocking part.
        restore_s: Seconds a restore after a preemption takes.
    """

    save_s: float = 0.0
    background_s: float = 0.0
    write_s: float = 0.0
    restore_s: float = 0.0

    def __post_init__(self) -> None:
        check_field("save_s", self.save_s, strict=False)
        check_field("background_s", self.background_s, strict=False)
        check_field("write_s", self.write_s, strict=False)
        check_field("restore_s", self.restore_s, strict=False)

    @property
    def write_share(self) -> float:
        """The share of the host's time a background write takes while it runs (1: all
        of it, the trainer waits)."""
        if self.write_s <= self.background_s:
            return 1.0
        return self.background_s / self.write_s


@dataclass(frozen=True, kw_only=True)
class WorkloadSpec:
    """What is generated: prompts per step, group size, and length distributions.

    Attributes:
        prompts_per_step: Prompt groups consumed per trainer step (the staleness
            policy's ``batch_size``).
        group_size: Samples generated per prompt (GRPO's G).
        prompt_tokens: Distribution of prompt lengths, in tokens.
        response_tokens: Distribution of completion lengths, in tokens (of every sample,
            whatever ``length_correlation``).
        length_correlation: How alike a group's samples are in length. ``None``
            (default): every sample draws its length independently. A number
            ``ρ`` in ``[0, 1]``: lengths are coupled by a Gaussian copula, each sample's
            normal score ``√ρ·z_group + √(1−ρ)·z_own`` mapped through the quantiles of
            ``response_tokens``, so every sample still has the law ``response_tokens``
            while two samples of a group correlate by ``ρ`` in normal scores (0:
            independent; 1: one length per group). GRPO's samples share a prompt and,
            with it, much of their length; drawn independently, a preempted worker's
            groups hold less work than real ones do. :func:`sim.calibration.calibrate.calibrate`
            fits ``ρ`` from a single-turn trace.
        max_response_tokens: Truncation length (finish reason ``length``); ``None``:
            never truncated.
        filtered_fraction: Share of finished groups that dynamic filtering drops
            because all their rewards are equal (no learning signal; DAPO, AReaL). The
            runtime's buffer does this; a calibrated scenario takes the share it
            measured. Each group is dropped independently with this probability.
        turns: Distribution of the tool calls of one episode (rounded, at least 0);
            the default 0 is a single-turn workload. An episode with ``k`` calls has
            ``k + 1`` policy turns, each as long as a draw of ``response_tokens``
            (capped by ``max_response_tokens``, as the engine caps a turn): it decodes
            a turn, waits for its tool, appends the observation and goes on
            (:mod:`sim.entities.worker`).
        tool_latency_s: Distribution of the seconds one tool call takes (e.g. a
            ``Lognormal`` for a long tail, or an ``Empirical`` fitted from a trace's
            ``tool_call`` events).
        observation_tokens: Distribution of the tokens a tool's answer appends.
        pass_rate: Distribution of a prompt's pass rate ``p`` (clipped to [0, 1]): each
            of its samples is correct with probability ``p``. Only the distribution
            audit reads it (``SimResult.audit``: sampled against trained pass rate and
            length, ``rlaxkit.rules.audit``).
        hard_length_factor: How much longer a hard prompt's completions are: a prompt of
            pass rate ``p`` draws ``response_tokens × (1 + (factor − 1)(1 − p))`` (1: length
            and difficulty are independent). A single-turn workload's setting.
    """

    prompts_per_step: int
    group_size: int = 1
    prompt_tokens: Distribution = field(default_factory=lambda: Constant(value=0.0))
    response_tokens: Distribution = field(default_factory=lambda: Constant(value=1.0))
    length_correlation: float | None = None
    max_response_tokens: int | None = None
    filtered_fraction: float = 0.0
    turns: Distribution = field(default_factory=lambda: Constant(value=0.0))
    tool_latency_s: Distribution = field(default_factory=lambda: Constant(value=0.0))
    observation_tokens: Distribution = field(default_factory=lambda: Constant(value=0.0))
    pass_rate: Distribution = field(default_factory=lambda: Constant(value=0.5))
    hard_length_factor: float = 1.0

    def __post_init__(self) -> None:
        check_field("prompts_per_step", self.prompts_per_step, integer=True)
        if not (is_number(self.hard_length_factor) and 1 <= self.hard_length_factor < math.inf):
            raise ValueError(
                f"hard_length_factor: must be a finite number >= 1, got {self.hard_length_factor!r}"
            )
        for name in ("turns", "tool_latency_s", "observation_tokens", "pass_rate"):
            value = getattr(self, name)
            if not isinstance(value, get_args(Distribution)):
                raise ValueError(
                    f"{name}: must be a distribution (Constant, Uniform, Lognormal, "
                    f"Empirical, LongTail), got {value!r}"
                )
        check_field("group_size", self.group_size, integer=True)
        value = self.filtered_fraction
        if not is_number(value) or not 0 <= value < 1:
            raise ValueError(
                f"filtered_fraction: must be a number in [0, 1), got {value!r} (at 1 no "
                "group would ever be trained)"
            )
        if self.max_response_tokens is not None:
            check_field("max_response_tokens", self.max_response_tokens, integer=True)
        rho = self.length_correlation
        if rho is not None and (not is_number(rho) or not 0 <= rho <= 1):
            raise ValueError(
                f"length_correlation: must be a number in [0, 1] (the correlation of a "
                f"group's lengths) or null for independent lengths, got {rho!r}"
            )

    @property
    def multi_turn(self) -> bool:
        """Whether episodes call tools (``turns`` has a mean above 0)."""
        return self.turns.mean() > 0

    @property
    def samples_per_step(self) -> int:
        """Sequences consumed per trainer step."""
        return self.prompts_per_step * self.group_size


@dataclass(frozen=True, kw_only=True)
class PreemptionSpec:
    """Random preemptions, turned into a seeded FaultPlan when a run starts.

    Attributes:
        worker_mtbf_s: Mean time between preemptions of one worker (``None``: never).
        slice_mtbf_s: Mean time between correlated preemptions of one slice.
        trainer_mtbf_s: Mean time between trainer preemptions.
        distribution: Inter-arrival law, ``exponential`` or ``weibull``.
        weibull_shape: Weibull shape k (only for ``weibull``).
    """

    worker_mtbf_s: float | None = None
    slice_mtbf_s: float | None = None
    trainer_mtbf_s: float | None = None
    distribution: InterArrival = "exponential"
    weibull_shape: float = 1.0

    def __post_init__(self) -> None:
        for name in ("worker_mtbf_s", "slice_mtbf_s", "trainer_mtbf_s"):
            if getattr(self, name) is not None:
                check_field(name, getattr(self, name))
        if self.distribution not in get_args(InterArrival):
            raise ValueError(
                f"distribution: must be one of {get_args(InterArrival)}, got {self.distribution!r}"
            )
        check_field("weibull_shape", self.weibull_shape)
