"""The chips a plan is read against: one table of accelerators' memory and speed.

Both the plan's config (``rlaxkit.planning.specs``, its ``chip`` field) and the TPU
topologies (``rlaxkit.planning.tpu``, each generation's chip) read it; it reads nothing of
the planner.
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 1024**3


@dataclass(frozen=True, kw_only=True)
class ChipSpec:
    """One accelerator chip.

    Attributes:
        name: the key in ``CHIPS``.
        hbm_bytes: memory of one chip.
        peak_flops: dense bf16 FLOP/s of one chip.
        hbm_bytes_per_s: memory bandwidth of one chip.
    """

    name: str
    hbm_bytes: float
    peak_flops: float
    hbm_bytes_per_s: float


# Vendors' public spec sheets (Cloud TPU system architecture pages; NVIDIA's H100 SXM
# datasheet, dense bf16 without sparsity). The only table of chips in rlaxkit.
CHIPS: dict[str, ChipSpec] = {
    "v4": ChipSpec(name="v4", hbm_bytes=32 * GIB, peak_flops=275e12, hbm_bytes_per_s=1.2e12),
    "v5e": ChipSpec(name="v5e", hbm_bytes=16 * GIB, peak_flops=197e12, hbm_bytes_per_s=0.82e12),
    "v5p": ChipSpec(name="v5p", hbm_bytes=95 * GIB, peak_flops=459e12, hbm_bytes_per_s=2.76e12),
    "v6e": ChipSpec(name="v6e", hbm_bytes=32 * GIB, peak_flops=918e12, hbm_bytes_per_s=1.64e12),
    "h100": ChipSpec(name="h100", hbm_bytes=80 * GIB, peak_flops=989e12, hbm_bytes_per_s=3.35e12),
}
