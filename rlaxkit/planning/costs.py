"""A compiled plan: what XLA said about each program, and what follows from it for a
chip (fits or not, what to change, step time at an MFU, KV-cache and push bytes, the
simulator's inputs). Plain Python: reading a plan needs no JAX."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from rlaxkit.config.io import from_dict, to_dict
from rlaxkit.models.config import ModelConfig
from rlaxkit.planning.chips import CHIPS, GIB, ChipSpec
from rlaxkit.planning.specs import PlanConfig
from rlaxkit.planning.tpu import parse_topology

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2}


@dataclass(frozen=True, kw_only=True)
class ProgramCost:
    """XLA's analysis of one compiled program, per device.

    Attributes:
        name: ``train``, ``prefill`` or ``decode``.
        devices: chips the program is partitioned over.
        argument_bytes, output_bytes: its inputs and outputs on one device.
        alias_bytes: outputs written into donated inputs (counted once).
        temp_bytes: XLA's scratch buffers on one device.
        flops: FLOPs on one device (for ``train`` the whole step, loops unrolled; for
            ``decode`` one decode step).
        bytes_accessed: bytes read and written on one device (XLA's count).
        compile_s: seconds to lower and compile it here (wall clock).
        compile_cpu_s: CPU seconds of the compile process for it (all threads): the
            measure of compile cost that another job on the machine does not inflate.
        loop_flops: XLA's own count for the program (loop bodies counted once).
        optimal_s: XLA:TPU's estimate of the program's seconds (``optimal_seconds``;
            0 from XLA:CPU), scaled like ``flops`` for the train step; ``decode``'s is
            one decode step (its loop body).
        loop_optimal_s: XLA:TPU's own estimate for the program (loop bodies once).
        compiled: ``False`` where XLA:TPU refused the program for want of HBM; then
            ``temp_bytes`` is the total it said the program needs, the other sizes 0.
        refusal: the compiler's message when it refused.
    """

    name: str
    devices: int
    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    temp_bytes: int
    flops: float
    bytes_accessed: float
    compile_s: float
    compile_cpu_s: float = 0.0
    loop_flops: float = 0.0
    optimal_s: float = 0.0
    loop_optimal_s: float = 0.0
    compiled: bool = True
    refusal: str = ""

    @property
    def peak_bytes(self) -> int:
        """Memory the program needs on one device: arguments, outputs not written into
        donated arguments, and temporaries."""
        return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes


@dataclass(frozen=True, kw_only=True)
class Plan:
    """The compiled programs of a ``PlanConfig`` read against its chip.

    With ``config.target`` every figure comes from XLA:TPU compiling the real programs
    for that slice: memory exact for that compiler version, time its estimate
    (``optimal_s``). Without one they come from XLA's CPU compiler partitioning them for
    forced host devices: an estimate of a TPU's, whose compiler fuses and lays out
    differently (``docs/running_at_scale.md``, "Before you rent").
    """

    config: PlanConfig
    model: ModelConfig
    programs: tuple[ProgramCost, ...]
    wall_s: float = 0.0
    cpu_s: float = 0.0

    @classmethod
    def from_summary(cls, summary: dict[str, Any]) -> Plan:
        """The plan back from its ``summary()`` (e.g. stored by ``rlaxkit plan --json``)."""
        config = from_dict(PlanConfig, summary["config"])
        fields = {f.name for f in dataclasses.fields(ProgramCost)}
        programs = tuple(
            from_dict(ProgramCost, {k: v for k, v in p.items() if k in fields})
            for p in summary["programs"].values()
        )
        return cls(
            config=config,
            model=config.model_config(),
            programs=programs,
            wall_s=summary.get("wall_s", 0.0),
            cpu_s=summary.get("cpu_s", 0.0),
        )

    @property
    def chip(self) -> ChipSpec:
        """The chip the plan is read against."""
        return CHIPS[self.config.chip]

    def program(self, name: str) -> ProgramCost:
        """The program called ``name``."""
        for program in self.programs:
            if program.name == name:
                return program
        raise KeyError(f"the plan compiled no {name!r} program (programs: {self.config.programs})")

    @property
    def compiler(self) -> str:
        """Which compiler's figures these are."""
        return f"XLA:TPU for {self.target_name}" if self.config.target else "XLA:CPU estimate"

    @property
    def target_name(self) -> str:
        """libtpu's name of the target slice (``""`` without one)."""
        if not self.config.target:
            return ""
        return parse_topology(self.config.target).name

    @property
    def devices_per_chip(self) -> int:
        """JAX devices per chip: 2 for a v4 target (each TensorCore), else 1."""
        if not self.config.target:
            return 1
        return parse_topology(self.config.target).generation.devices_per_chip

    @property
    def hbm_bytes(self) -> float:
        """HBM of one device (a chip, or a v4 TensorCore's half)."""
        return self.chip.hbm_bytes / self.devices_per_chip

    @property
    def device_peak_flops(self) -> float:
        """Peak bf16 FLOP/s of one device."""
        return self.chip.peak_flops / self.devices_per_chip

    def fits(self, name: str) -> bool:
        """Whether ``name``'s per-device memory is within the device's HBM (and the
        compiler did not refuse it)."""
        program = self.program(name)
        return program.compiled and program.peak_bytes <= self.hbm_bytes

    def est_s(self, name: str) -> float:
        """XLA:TPU's estimate of ``name``'s seconds (0 without a target); for ``decode``
        one decode step, for ``train`` the whole step."""
        return self.program(name).optimal_s

    @property
    def est_mfu(self) -> float:
        """Model FLOPs of the train step over the compiler's time at the device's peak
        (0 without a target)."""
        train = self.program("train")
        if not train.optimal_s:
            return 0.0
        return train.flops / (train.optimal_s * self.device_peak_flops)

    @property
    def decode_tokens_per_s_per_chip(self) -> float:
        """Tokens a worker chip decodes per second, every slot running at the cache's
        full length, at the compiler's estimate of one decode step (0 without one)."""
        step = self.program("decode").optimal_s
        if not step:
            return 0.0
        return self.config.slots / step / (self.config.sampler_chips / self.devices_per_chip)

    @property
    def tokens_per_step(self) -> int:
        """Trained tokens per step (``rows × length``)."""
        return self.config.rows * self.config.length

    @property
    def step_flops(self) -> float:
        """FLOPs of one train step on all the trainer's chips."""
        return self.program("train").flops * self.config.trainer_chips

    @property
    def step_s(self) -> float:
        """Train step time at the chip's peak times ``config.mfu``."""
        return self.program("train").flops / (self.chip.peak_flops * self.config.mfu)

    @property
    def trainer_tokens_per_s(self) -> float:
        """Trained tokens per second at ``step_s`` (0 when the train step has no FLOPs:
        XLA:TPU refused it, or one of its probes, as not fitting)."""
        return self.tokens_per_step / self.step_s if self.step_s else 0.0

    @property
    def kv_cache_bytes(self) -> int:
        """KV cache of one worker: ``slots × length`` tokens of every layer's K and V."""
        per_token = kv_bytes_per_token(self.model, self.config.compute_dtype)
        return self.config.slots * self.config.length * per_token

    @property
    def push_bytes(self) -> int:
        """Bytes of one weight push (every parameter in the compute dtype)."""
        return self.model.num_params() * self._compute_bytes

    @property
    def _compute_bytes(self) -> int:
        return _DTYPE_BYTES[self.config.compute_dtype]

    def decode_s_per_token(self) -> tuple[float, float]:
        """``(fixed, per running sequence)`` seconds of one decode step, memory-bound.

        Each step reads a worker chip's share of the weights once and, per running
        sequence, its share of that sequence's KV cache at the cache's full length (the
        sampler attends over every slot, masked), at ``decode_efficiency`` of the chip's
        HBM bandwidth. From shapes, not from XLA's byte count of the decode program,
        which the sampling step inflates far beyond what the step reads (see
        ``docs/running_at_scale.md``).
        """
        c = self.config
        rate = self.chip.hbm_bytes_per_s * c.decode_efficiency * c.sampler_chips
        per_seq = c.length * kv_bytes_per_token(self.model, c.compute_dtype)
        return self.push_bytes / rate, per_seq / rate

    def decode_step_s(self) -> float:
        """One decode step with every slot running."""
        fixed, per_seq = self.decode_s_per_token()
        return fixed + self.config.slots * per_seq

    def advice(self, name: str) -> list[str]:
        """What to change so that ``name`` fits (empty when it fits)."""
        if self.fits(name):
            return []
        p, c = self.program(name), self.config
        over = (p.peak_bytes - self.hbm_bytes) / GIB
        tips = [f"{over:.1f} GiB over the {self.chip.name}'s {self.hbm_bytes / GIB:.0f} GiB"]
        if not p.compiled:
            tips = [f"XLA:TPU refused it: {p.refusal}"]
        if name == "train":
            if c.remat != "full":
                nxt = "dots" if c.remat == "none" else "full"
                tips.append(
                    f"remat={nxt} (keeps fewer activations; temporaries now "
                    f"{p.temp_bytes / GIB:.1f} GiB)"
                )
            shards = c.mesh[0] * c.mesh[1]
            if c.rows % (2 * c.micro_batches * shards) == 0:
                tips.append(f"micro_batches={2 * c.micro_batches} (about halves the activations)")
            held = f"the {p.argument_bytes / GIB:.1f} GiB of " if p.compiled else ""
            tips.append(
                f"fsdp={2 * c.mesh[1]} (spreads {held}weights, moments and batch per "
                "device; twice the chips)"
            )
        else:
            # Weights and cache split over the worker's chips: enough chips that each
            # holds its share (a power of two, as slices come).
            need = -(-c.sampler_chips * p.peak_bytes // int(self.hbm_bytes))
            chips = max(2 * c.sampler_chips, 1 << (int(need) - 1).bit_length())
            tips.append(
                f"sampler_chips={chips} (splits the weights and cache: "
                f"{p.peak_bytes / GIB:.1f} GiB over {c.sampler_chips} now)"
            )
            if name != "publish" and c.slots > c.samples_per_prompt:
                tips.append(
                    f"slots={max(c.slots // 2, c.samples_per_prompt)} (KV cache now "
                    f"{self.kv_cache_bytes / GIB:.1f} GiB per worker)"
                )
        return tips

    def sim_overrides(self) -> dict[str, Any]:
        """The simulator's inputs, as dotted scenario paths (``sim.with_overrides``;
        ``sim.presets.planned`` applies them): the trainer's chips, FLOPs per token (from
        the compiled step) and MFU; when the sampler was planned, the worker's shape and
        decode cost; the push bytes; with ``total_chips``, the workers beside the trainer.

        With a target, the times are XLA:TPU's estimates: the MFU is ``est_mfu`` (so the
        simulated step takes the compiler's ``est_s("train")``), one decode step with
        every slot running takes ``est_s("decode")`` (split into a fixed and a per-slot
        part in the proportion of the bytes each reads, ``decode_s_per_token``), the
        prefill rate is the prefill program's tokens over its estimate, and a push is
        one worker's share of the ``publish`` program's output. Without one, the MFU and
        HBM efficiency the config assumes (the labelled fallback)."""
        c = self.config
        out: dict[str, Any] = {"param_server.weight_bytes": float(self.push_bytes)}
        names = {p.name for p in self.programs}
        # A train step XLA:TPU refused (with its probes) has no FLOPs: the simulator
        # keeps its own trainer figures rather than a step of no work.
        if "train" in names and self.step_flops:
            params = float(self.model.num_params())
            out.update(
                {
                    "trainer.chips": c.trainer_chips // self.devices_per_chip,
                    "trainer.model_params": params,
                    "trainer.chip_flops": self.chip.peak_flops,
                    "trainer.mfu": min(self.est_mfu, 1.0) or c.mfu,
                    "trainer.flops_per_token_factor": self.step_flops
                    / (self.tokens_per_step * params),
                }
            )
        if {"prefill", "decode"} & names:
            fixed, per_seq = self.decode_s_per_token()
            if "decode" in names and self.est_s("decode"):
                scale = self.est_s("decode") / (fixed + c.slots * per_seq)
                fixed, per_seq = fixed * scale, per_seq * scale
            out.update(
                {
                    "fleet.chips_per_worker": c.sampler_chips // self.devices_per_chip,
                    "fleet.slots_per_worker": c.slots,
                    "fleet.decode_s_per_token": fixed,
                    "fleet.decode_s_per_token_per_seq": per_seq,
                }
            )
            if "prefill" in names and self.est_s("prefill"):
                prompts = c.slots // c.samples_per_prompt
                rate = prompts * c.prompt_tokens / self.est_s("prefill")
                out["fleet.prefill_tokens_per_s"] = rate
        if "publish" in names and c.target:
            publish = self.program("publish")
            out["param_server.weight_bytes"] = float(publish.output_bytes * c.sampler_chips)
        if c.total_chips:
            out["fleet.num_workers"] = (c.total_chips - c.trainer_chips) // c.sampler_chips
        return out

    def summary(self) -> dict[str, Any]:
        """The plan's figures as plain data (one JSON object)."""
        names = {p.name for p in self.programs}
        out: dict[str, Any] = {
            "config": to_dict(self.config),
            "params": self.model.num_params(),
            "chip": self.chip.name,
            "compiler": self.compiler,
            "hbm_bytes": self.hbm_bytes,
            "programs": {
                p.name: {**to_dict(p), "peak_bytes": p.peak_bytes, "fits": self.fits(p.name)}
                for p in self.programs
            },
            "advice": {p.name: self.advice(p.name) for p in self.programs},
            "kv_cache_bytes": self.kv_cache_bytes,
            "push_bytes": self.push_bytes,
            "sim_overrides": self.sim_overrides(),
            "wall_s": self.wall_s,
            "cpu_s": self.cpu_s,
        }
        if "train" in names:
            out |= {
                "step_flops": self.step_flops,
                "step_s": self.step_s,
                "trainer_tokens_per_s": self.trainer_tokens_per_s,
                "est_step_s": self.est_s("train"),
                "est_mfu": self.est_mfu,
            }
        if {"prefill", "decode"} & names:
            out["decode_step_s"] = self.decode_step_s()
        if "decode" in names:
            out["est_decode_step_s"] = self.est_s("decode")
            out["decode_tokens_per_s_per_chip"] = self.decode_tokens_per_s_per_chip
        return out

    def table(self) -> str:
        """The plan as text: one line per program, then the derived figures."""
        c, chip = self.config, self.chip
        lines = [
            f"plan: {c.model} ({self.model.num_params() / 1e9:.2f}B params, "
            f"{self.model.num_layers} layers), trainer mesh {c.mesh} = {c.trainer_chips} "
            f"{chip.name} chips, {c.rows} x {c.length} tokens, micro_batches "
            f"{c.micro_batches}, remat {c.remat}, {c.master_dtype} master / "
            f"{c.compute_dtype} compute",
            f"{self.compiler}; per device (GiB):",
            "program  devs     args    outs   alias   temps    peak  / HBM   fits   "
            "TFLOPs  est. s  compile s",
        ]
        for p in self.programs:
            lines.append(
                f"{p.name:<8} x{p.devices:<5} {p.argument_bytes / GIB:7.2f} "
                f"{p.output_bytes / GIB:7.2f} {p.alias_bytes / GIB:7.2f} "
                f"{p.temp_bytes / GIB:7.2f} {p.peak_bytes / GIB:7.2f} / "
                f"{self.hbm_bytes / GIB:<5.0f}"
                f" {'yes' if self.fits(p.name) else 'NO':<5} {p.flops / 1e12:8.2f} "
                f"{p.optimal_s:7.3g} {p.compile_s:8.1f}"
            )
            for tip in self.advice(p.name):
                lines.append(f"    change: {tip}")
        names = {p.name for p in self.programs}
        if "train" in names:
            lines.append(
                f"train step: {self.step_flops / 1e15:.2f} PFLOPs in all; "
                f"{self.step_s:.2f} s at {c.mfu:.0%} MFU of {chip.peak_flops / 1e12:.0f} "
                f"TFLOP/s per chip = {self.trainer_tokens_per_s:,.0f} tokens/s"
            )
        lines.append(
            f"KV cache: {self.kv_cache_bytes / GIB:.2f} GiB per worker ({c.slots} slots x "
            f"{c.length} tokens); weight push: {self.push_bytes / GIB:.2f} GiB "
            f"({c.compute_dtype})"
        )
        if {"prefill", "decode"} & names:
            lines.append(
                f"decode step ({c.slots} rows at full length, weights and KV cache read at "
                f"{c.decode_efficiency:.0%} of HBM bandwidth): {self.decode_step_s() * 1e3:.1f} ms"
            )
        if "train" in names and self.est_s("train"):
            lines.append(
                f"XLA:TPU's estimate of the train step: {self.est_s('train'):.2f} s = "
                f"{self.est_mfu:.0%} MFU ({self.tokens_per_step / self.est_s('train'):,.0f} "
                "tokens/s)"
            )
        if "decode" in names and self.est_s("decode"):
            lines.append(
                f"XLA:TPU's estimate of one decode step ({c.slots} rows at full length): "
                f"{self.est_s('decode') * 1e3:.1f} ms = "
                f"{self.decode_tokens_per_s_per_chip:,.0f} tokens/s per worker chip"
            )
        if c.target:
            lines.append(
                f"XLA:TPU for {self.target_name}: memory exact for this libtpu; times the "
                f"compiler's estimate, not a measurement; compiled in {self.wall_s:.0f} s"
                + (f" ({self.cpu_s:.0f} CPU s)" if self.cpu_s else "")
            )
        else:
            lines.append(
                "XLA:CPU estimate: XLA's CPU compiler, not the TPU's (other fusion and "
                f"layouts); compiled in {self.wall_s:.0f} s"
                + (f" ({self.cpu_s:.0f} CPU s)" if self.cpu_s else "")
            )
        return "\n".join(lines)


def kv_bytes_per_token(model: ModelConfig, dtype: str) -> int:
    """KV-cache bytes of one token: every layer's keys and values."""
    return model.num_layers * 2 * model.num_kv_heads * model.head_dim * _DTYPE_BYTES[dtype]
