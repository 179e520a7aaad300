"""The run configuration: one frozen dataclass tree for a whole RL run, read from YAML.

Each component keeps its own config where it lives (``ModelConfig``, ``SamplingConfig``,
``OptimizerConfig``, the policies, ``SFTConfig``); this module nests them and adds the
few run-level settings. ``RunConfig()`` is the embedded default: a tiny character-level
Qwen3-shaped model learning two-digit addition with asynchronous GRPO (η = 2) on the
local backend, small enough to learn on two CPU cores in minutes.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from rlaxkit.algorithms import PRESETS, algorithm
from rlaxkit.algorithms.config import AdvantageConfig, LossConfig
from rlaxkit.algorithms.distill import DistillConfig
from rlaxkit.config.io import apply_overrides, dump_yaml, from_dict, load_yaml, to_dict
from rlaxkit.config.ray import RayConfig
from rlaxkit.inference import SamplingConfig
from rlaxkit.inference.config import InferenceConfig, bucket_length
from rlaxkit.models.config import ModelConfig
from rlaxkit.models.lora import LoraConfig
from rlaxkit.observe.tracking import TrackerName, check_tracking
from rlaxkit.param_server import ParamServerConfig
from rlaxkit.rules.paging import check_pages
from rlaxkit.rules.policies import (
    BatchPolicy,
    CheckpointPolicy,
    RecoveryPolicy,
    StalenessPolicy,
    WeightSyncPolicy,
    check_admission,
)
from rlaxkit.rules.validation import check_int, check_number
from rlaxkit.serve.config import AgentConfig
from rlaxkit.tasks.episodes import EpisodeConfig
from rlaxkit.tasks.registry import build_config, task_config_class
from rlaxkit.trainer.config import OptimizerConfig
from rlaxkit.trainer.sft import SFTConfig


def _tiny_model() -> ModelConfig:
    # vocab_size is set from the tokenizer when the run starts (0 = "take it from there").
    return ModelConfig(
        family="qwen3",
        vocab_size=16,
        hidden_size=64,
        intermediate_size=256,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        max_position_embeddings=64,
        rope_theta=10_000.0,
    )


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """Which policy to train.

    Attributes:
        checkpoint: a local Hugging Face checkpoint directory; when set, ``config`` is
            ignored and the checkpoint's tokenizer is used.
        config: the architecture of a freshly initialised model (with a character
            tokenizer over the task's alphabet; ``vocab_size`` is taken from it).
        param_dtype: override the checkpoint's dtype (``float32`` on CPU).
        sampler_dtype: the inference workers' weight and compute dtype, when it differs
            from the trainer's: each pulled version is cast to it (``bfloat16``: a
            sampler whose log-probs differ from the trainer's for the same weights, the
            engine mismatch ``drift/mismatch`` measures). ``None``: the trainer's.
    """

    checkpoint: str | None = None
    config: ModelConfig = field(default_factory=_tiny_model)
    param_dtype: Literal["float32", "bfloat16"] | None = None
    sampler_dtype: Literal["float32", "bfloat16"] | None = None


@dataclass(frozen=True, kw_only=True)
class TaskSpec:
    """The task, found by name in ``rlaxkit.tasks`` (``options`` go to its config).

    Attributes:
        name: registered task name.
        options: fields of the task's config.
        num_train: training problems (``None``: the task's default).
    """

    name: str = "arithmetic"
    options: dict[str, Any] = field(
        default_factory=lambda: {"operators": ["+"], "min_digits": 1, "max_digits": 2}
    )
    num_train: int | None = None

    def __post_init__(self) -> None:
        # The options are checked here, when the config is read, as every other field is
        # (the package import registers the tasks, so any task name is found).
        build_config(task_config_class(self.name), self.options, where=f"task {self.name!r}")
        if self.num_train is not None:
            check_int("num_train", self.num_train, minimum=1)


@dataclass(frozen=True, kw_only=True)
class AlgorithmSpec:
    """An algorithm preset by name, with optional changes to its slots."""

    preset: str = "grpo"
    advantage: dict[str, Any] = field(default_factory=dict)
    loss: dict[str, Any] = field(default_factory=lambda: {"kl_coef": 0.0})

    def __post_init__(self) -> None:
        """Builds the algorithm once, so a bad preset or slot fails when the config is
        read, before a run makes its folder or warms up."""
        if self.preset not in PRESETS:
            raise ValueError(
                f"preset: unknown algorithm preset {self.preset!r}; one of {sorted(PRESETS)}"
            )
        for slot, cls in (("advantage", AdvantageConfig), ("loss", LossConfig)):
            allowed = {f.name for f in dataclasses.fields(cls)}
            unknown = sorted(set(getattr(self, slot)) - allowed)
            if unknown:
                raise ValueError(f"{slot}: unknown field(s) {unknown}; allowed: {sorted(allowed)}")
        overrides = {k: v for k, v in (("advantage", self.advantage), ("loss", self.loss)) if v}
        try:
            algorithm(self.preset, **overrides)
        except (TypeError, ValueError) as error:
            raise ValueError(f"{self.preset}: {error}") from error


@dataclass(frozen=True, kw_only=True)
class TrainerSpec:
    """How a batch is cut into updates, and what is trained (see
    ``rlaxkit.trainer.config.TrainConfig``): every weight, or LoRA adapters (``lora``, e.g.
    ``--set trainer.lora.rank=8``)."""

    micro_batches: int = 1
    mini_batches: int = 1
    epochs: int = 1
    lora: LoraConfig | None = None


@dataclass(frozen=True, kw_only=True)
class DistillSpec:
    """On-policy distillation from a frozen teacher (``rlaxkit.algorithms.distill``): the
    teacher scores the student's own samples in the train step; the reverse KL to it
    trains the student (``estimator``).

    Attributes:
        teacher: an HF checkpoint directory (a run's ``final/``, or any checkpoint with
            the student's vocabulary); the teacher may be of another size. Read when the
            run starts, which checks it is there and that its vocabulary is the student's.
        weight: scale of the distillation reward in the advantage, or of the KL term.
        task_reward: add the task's advantage (``true``) or distil alone (``false``).
        param_dtype: the teacher's dtype (default: the checkpoint's).
        estimator: ``sampled``: the sampled token's ``log π_teacher - log π_student`` as
            its advantage; ``full``: the exact KL over the vocabulary in the loss (GKD).
    """

    teacher: str | None = None
    weight: float = 1.0
    task_reward: bool = True
    param_dtype: Literal["float32", "bfloat16"] | None = None
    estimator: Literal["sampled", "full"] = "sampled"

    def __post_init__(self) -> None:
        if not isinstance(self.teacher, str) or not self.teacher:
            raise ValueError(
                f"teacher: missing (got {self.teacher!r}); set distill.teacher to the "
                "teacher's checkpoint directory (a run's final/), or unset distill"
            )
        DistillConfig(weight=self.weight, task_reward=self.task_reward, estimator=self.estimator)


@dataclass(frozen=True, kw_only=True)
class RuntimeConfig:
    """The runtime's shape.

    Attributes:
        backend: ``local`` (one process, the embedded default) or ``ray``.
        mode: ``deterministic`` interleaves worker chunks and trainer steps in a fixed
            order (same seed, same metrics); ``concurrent`` runs workers in threads.
        num_workers: inference workers.
        slots_per_worker: decode rows of each worker's continuous-batching engine.
        chunk_steps: decode steps between two points where a worker may take weights.
        max_prompt_tokens: longest prompt a worker accepts.
        keep_versions: weight versions the parameter server keeps.
        round_s: logical seconds one decode round counts for in deterministic mode. In
            that mode the clock that fires timed faults (``FaultPlan`` ``at_s``), times
            their downtimes and drives ``CheckpointPolicy.every_s`` is ``rounds ·
            round_s`` (a round: every live worker decodes one chunk), never the wall
            clock, so a plan replays identically run after run.
        restart_s: downtime of a preempted worker, trainer or parameter server whose
            fault gives no ``restart_after_s`` (seconds of the fault clock).
        workers_per_slice: workers that share one slice (``slice-i`` holds workers
            ``i·k .. i·k+k-1``); ``preempt_slice`` takes all of them down together.
        trace_memory: with a run directory, about how many of the newest trace events
            ``Experiment.trace.memory`` keeps (a step writes two per sample; the oldest
            go first, and trace.jsonl keeps every one: ``rlaxkit.rules.trace.read_trace``).
            ``None`` keeps all. Without a run directory memory keeps every event.
        trainer_replay_mb: on Ray, how many megabytes of trained batches the driver
            keeps to heal a trainer process that dies on its own: the trainer restores
            its newest checkpoint and the driver replays the batches trained since. A
            checkpoint lets go of the batches it covers; past the bound the oldest go
            first, and a death that would need one of them stops the run with an error
            naming ``checkpoint.every_steps``. ``None`` keeps every batch (without
            checkpoints, all of the run's).
        overlap_training: in deterministic mode, the fleet's rounds for the next batch
            run while the trainer takes a step, on the weights published before it,
            until the buffer holds that batch (``rlaxkit.runtime.loop``,
            ``Loop.run_ahead``); the step's push waits for them. A run stays the same
            run after run, but is not the serial run: its rollouts are up to one
            version older, so it needs ``staleness.max_staleness >= 1``.
        threaded_chunks: on the local placement in deterministic mode, the busy
            workers' chunks of a round decode at once, each on a thread of its own;
            their results are then fetched and scored in worker order on the driver's
            thread, so a run gives the same metrics either way. On XLA:CPU a worker's
            chunk runs on one core, so this uses a core a worker. ``false``: one chunk
            after another. (On Ray every worker is a process and decodes at once.)
        cache_views: each worker's engine decodes a chunk on the shortest of eight
            cache prefixes that holds its rows' next writes, when a row's cache holds
            64 new tokens or more (``rlaxkit.inference.engine.engine_views``): the
            same tokens, attention over fewer slots while the rows are short, and up to
            eight decode programs to compile instead of one. ``false``: the whole cache.
    """

    backend: Literal["local", "ray"] = "local"
    mode: Literal["deterministic", "concurrent"] = "deterministic"
    num_workers: int = 2
    slots_per_worker: int = 64
    chunk_steps: int = 4
    max_prompt_tokens: int = 16
    keep_versions: int = 4
    round_s: float = 1.0
    restart_s: float = 5.0
    workers_per_slice: int = 1
    trace_memory: int | None = 100_000
    trainer_replay_mb: float | None = 4096.0
    overlap_training: bool = False
    threaded_chunks: bool = True
    cache_views: bool = True

    def __post_init__(self) -> None:
        for name in (
            "num_workers",
            "slots_per_worker",
            "chunk_steps",
            "max_prompt_tokens",
            "workers_per_slice",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.trace_memory is not None:
            check_int(
                "trace_memory", self.trace_memory, minimum=1, allowed="an integer >= 1 or null"
            )
        if self.trainer_replay_mb is not None:
            check_number(
                "trainer_replay_mb",
                self.trainer_replay_mb,
                minimum=0.0,
                allowed="a number >= 0 (megabytes) or null",
            )
        if self.keep_versions < 2:
            raise ValueError(f"keep_versions must be >= 2, got {self.keep_versions}")
        if not isinstance(self.overlap_training, bool):
            raise ValueError(
                f"overlap_training must be true or false, got {self.overlap_training!r}"
            )
        if not isinstance(self.threaded_chunks, bool):
            raise ValueError(f"threaded_chunks must be true or false, got {self.threaded_chunks!r}")
        if not isinstance(self.cache_views, bool):
            raise ValueError(f"cache_views must be true or false, got {self.cache_views!r}")
        if self.overlap_training and self.mode == "concurrent":
            raise ValueError(
                "overlap_training: the concurrent mode overlaps training with generation "
                "already (its workers run in threads); it is a setting of "
                "mode=deterministic: unset one of them"
            )
        if not (self.round_s > 0 and math.isfinite(self.round_s)):  # 0 rounds · inf is NaN
            raise ValueError(
                "round_s must be a finite number > 0 (logical seconds per round), "
                f"got {self.round_s}"
            )
        if not self.restart_s >= 0:
            raise ValueError(f"restart_s must be >= 0, got {self.restart_s}")


@dataclass(frozen=True, kw_only=True)
class EvalConfig:
    """Held-out evaluation: pass@1 and pass@k at the training temperature.

    Attributes:
        num_problems: test-split problems evaluated.
        samples: samples per problem (pass@1 is their mean; pass@k uses all of them).
        every_steps: evaluate during training every this many steps (0: only at the
            start and the end).
    """

    num_problems: int = 200
    samples: int = 4
    every_steps: int = 0

    def __post_init__(self) -> None:
        check_int("num_problems", self.num_problems, minimum=1)
        check_int("samples", self.samples, minimum=1)
        check_int("every_steps", self.every_steps, minimum=0)


@dataclass(frozen=True, kw_only=True)
class MetricsConfig:
    """What the trainer measures beside its loss.

    Attributes:
        drift_every: every this many train steps the trainer splits the drift of the
            batch's log-ratios into staleness and engine mismatch (``rlaxkit.observe.drift``:
            ``drift/*`` metrics; one more forward pass over the batch and one per older
            weight version in it). 0 (the default): never. A batch that needs a version
            the parameter server no longer holds is skipped and counted
            (``drift/skipped_batches``). Off by default: the attribution compiles its
            programs per batch shape and costs more the staler the batch, so it changes
            a run's timings by its staleness (calibrated on an η = 1 run with it every
            10 steps, the simulator predicted the η = 0 run 29 % slow; 10 % without).
    """

    drift_every: int = 0

    def __post_init__(self) -> None:
        check_int("drift_every", self.drift_every, minimum=0)


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """Everything an RL run needs; ``RunConfig()`` is the embedded default run.

    The same config runs on either backend: ``runtime.backend`` picks ``local``
    (``rlaxkit.runtime.Experiment``) or ``ray`` (``rlaxkit.runtime.RayExperiment``), and
    ``ray`` (a ``rlaxkit.config.ray.RayConfig``: actor resources, weight store, restarts)
    says where the Ray backend places its actors; the local backend ignores it.
    ``tracking`` names where metrics go besides ``metrics.jsonl`` (always written):
    ``tensorboard``, ``wandb``, ``mlflow`` (``rlaxkit.observe.tracking``). ``param_server``
    turns on delta publication (``rlaxkit.param_server.ParamServerConfig``).
    ``episodes`` sets the turns, token budget and tool-step timeout of a multi-turn
    task's episodes (``rlaxkit.tasks.episodes.EpisodeConfig``; a single-turn task ignores it).
    ``inference`` chooses each worker's KV cache, dense or paged
    (``rlaxkit.inference.InferenceConfig``).
    ``distill`` adds a frozen teacher's per-token reward (``DistillSpec``).
    ``agent`` (``rlaxkit.serve.AgentConfig``) has a user's agent produce the samples
    through the OpenAI-compatible endpoint instead of the workers' episodes.
    ``metrics`` sets what the trainer measures beside its loss (drift attribution).
    """

    seed: int = 0
    steps: int = 200
    model: ModelSpec = field(default_factory=ModelSpec)
    task: TaskSpec = field(default_factory=TaskSpec)
    sampling: SamplingConfig = field(
        default_factory=lambda: SamplingConfig(temperature=1.0, max_new_tokens=8, n=8)
    )
    algorithm: AlgorithmSpec = field(default_factory=AlgorithmSpec)
    optimizer: OptimizerConfig = field(
        default_factory=lambda: OptimizerConfig(learning_rate=3e-4, warmup_steps=10)
    )
    trainer: TrainerSpec = field(default_factory=TrainerSpec)
    staleness: StalenessPolicy = field(
        default_factory=lambda: StalenessPolicy(max_staleness=2, batch_size=32)
    )
    weight_sync: WeightSyncPolicy = field(default_factory=WeightSyncPolicy)
    checkpoint: CheckpointPolicy = field(default_factory=CheckpointPolicy)
    batching: BatchPolicy = field(default_factory=BatchPolicy)
    recovery: RecoveryPolicy = field(default_factory=RecoveryPolicy)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    eval: EvalConfig = field(default_factory=lambda: EvalConfig(every_steps=50))
    ray: RayConfig = field(default_factory=RayConfig)
    param_server: ParamServerConfig = field(default_factory=ParamServerConfig)
    tracking: tuple[TrackerName, ...] = ("jsonl",)
    episodes: EpisodeConfig = field(default_factory=EpisodeConfig)
    inference: InferenceConfig = field(default_factory=InferenceConfig)
    distill: DistillSpec | None = None
    agent: AgentConfig | None = None
    metrics: MetricsConfig = field(default_factory=MetricsConfig)

    def __post_init__(self) -> None:
        check_tracking(self.tracking)  # before any work: a tracker's package is missing
        if self.steps < 0:
            raise ValueError(f"steps must be >= 0, got {self.steps}")
        check_admission(self.staleness, self.weight_sync)
        if self.runtime.overlap_training and self.staleness.max_staleness < 1:
            raise ValueError(
                "runtime.overlap_training needs staleness.max_staleness >= 1, got 0: the "
                "rollouts generated while the trainer takes step k use the weights before "
                "it and are trained at step k + 1; raise max_staleness or unset "
                "overlap_training"
            )
        if (
            self.param_server.delta
            and self.runtime.keep_versions < self.param_server.snapshot_every
        ):
            raise ValueError(
                f"param_server.snapshot_every is {self.param_server.snapshot_every} but "
                f"runtime.keep_versions is {self.runtime.keep_versions}: a delta-published "
                "version needs the versions since its snapshot; raise keep_versions or "
                "lower snapshot_every"
            )
        distil_alone = self.distill is not None and not self.distill.task_reward
        if distil_alone and self.batching.equal_rewards == "drop":
            raise ValueError(
                "distill.task_reward is false but batching.equal_rewards is drop: groups "
                "whose task rewards are all equal would be dropped, though the teacher still "
                "teaches on them; set batching.equal_rewards=keep"
            )
        group_relative = self.algorithm.preset in ("grpo", "dr_grpo", "dapo", "rloo")
        baseline_zero = self.algorithm.advantage.get("group_of_one") == "reward"
        if self.sampling.n < 2 and group_relative and not baseline_zero:
            raise ValueError(
                f"sampling.n is {self.sampling.n}; group-relative algorithms "
                f"({self.algorithm.preset}) need at least 2 samples per prompt, or "
                "algorithm.advantage.group_of_one=reward (baseline 0: the advantage is the "
                "reward)"
            )
        if group_relative and (self.sampling.greedy or self.sampling.top_k == 1):
            field_, value = (
                ("temperature", 0) if self.sampling.greedy else ("top_k", self.sampling.top_k)
            )
            raise ValueError(
                f"sampling.{field_} is {value}: every sample of a prompt is the same "
                f"completion, so {self.algorithm.preset}'s group-relative advantages are all "
                "zero and no step learns; sample at a temperature > 0 with top_k 0 or > 1"
            )
        if self.inference.kv_cache != "dense":  # ``auto`` is paged on TPU
            self._check_pages()

    def _check_pages(self) -> None:
        """A paged worker's pool runs a row of the longest prompt and its whole budget."""
        prompt = bucket_length(self.runtime.max_prompt_tokens)  # as the engine rounds it
        page_size = self.inference.page_size
        row_pages = -(-(prompt + self.sampling.max_new_tokens) // page_size)
        check_pages(
            page_size=page_size,
            num_pages=self.inference.num_pages or self.runtime.slots_per_worker * row_pages + 1,
            attention_block=self.inference.attention_block,
            max_prompt_tokens=prompt,
            max_new_tokens=self.sampling.max_new_tokens,
            prefix="inference.",
            new_tokens_field="sampling.max_new_tokens",
        )

    @property
    def group_size(self) -> int:
        """Samples per prompt (``sampling.n``): the size of a GRPO group."""
        return self.sampling.n

    def to_dict(self) -> dict[str, Any]:
        """The config as nested plain dicts (what ``config.yaml`` holds)."""
        return to_dict(self)

    @classmethod
    def from_dict(cls, data: dict[str, object]) -> RunConfig:
        """A validated config from nested dicts; a wrong name or value names its path.

        >>> from rlaxkit.config.io import apply_overrides
        >>> RunConfig.from_dict(apply_overrides(RunConfig().to_dict(), ["steps=5"])).steps
        5
        """
        return from_dict(cls, data, path="config")

    @classmethod
    def from_yaml(cls, path: str | Path, overrides: list[str] | None = None) -> RunConfig:
        """Reads a YAML config (only the fields it changes), then ``section.field=value``
        ``overrides``.

        The file is merged onto ``RunConfig()``'s values field by field, so a section given
        in part keeps the run's defaults for the rest. The default ``task.options`` are the
        default task's, so a file that names another task starts from no options.
        """
        config = load_yaml(cls, path, None, defaults=_defaults_for_file)
        return cls.from_overrides(overrides or [], base=config) if overrides else config

    @classmethod
    def from_overrides(cls, overrides: list[str], base: RunConfig | None = None) -> RunConfig:
        """``base`` (default ``RunConfig()``) with ``section.field=value`` overrides.

        An override that names another task starts it from no options (the base's are
        another task's), as a config file that names one does; options the overrides
        give then apply.

        >>> RunConfig.from_overrides(["task.name=countdown"]).task.options
        {}
        """
        data = (base or cls()).to_dict()
        task = data["task"]["name"]
        probe = apply_overrides(copy.deepcopy(data), overrides)  # it writes into its dict
        if probe["task"]["name"] != task:
            data["task"]["options"] = {}
        return cls.from_dict(apply_overrides(data, overrides))

    def save(self, path: str | Path) -> None:
        """Writes the full config as YAML (every field, so the run can be reproduced)."""
        dump_yaml(self, path)


def _defaults_for_file(data: dict[str, Any]) -> dict[str, Any]:
    defaults = RunConfig().to_dict()
    task = data.get("task")
    if (
        isinstance(task, dict)
        and task.get("name", defaults["task"]["name"]) != defaults["task"]["name"]
    ):
        defaults["task"]["options"] = {}
    return defaults


# A run small enough for a test, a notebook's CI settings or a quick benchmark: a
# 2-layer, 32-wide char model on one-digit sums, a short warm start, 4 prompts × 4
# samples per step. Seconds per run on two CPU cores.
SMALL_RUN: tuple[str, ...] = (
    "model.config.hidden_size=32",
    "model.config.intermediate_size=64",
    "model.config.num_layers=2",
    "task.options.max_digits=1",
    "task.num_train=80",
    "sft.steps=200",
    "sft.batch_size=32",
    "staleness.batch_size=4",
    "sampling.n=4",
    "runtime.slots_per_worker=16",
)


def small_run_config(*overrides: str) -> RunConfig:
    """``RunConfig()`` with ``SMALL_RUN`` and then ``overrides`` (``"section.field=value"``)
    applied, e.g. ``small_run_config("staleness.max_staleness=0")``."""
    return RunConfig.from_overrides(list(overrides), base=RunConfig.from_overrides(list(SMALL_RUN)))
