"""Seeded distributions for the workload: response lengths, prompt lengths, latencies.

Each distribution is a frozen dataclass with ``sample(rng) -> float`` taking a
``random.Random``, ``sample_many(generator, n)`` taking a NumPy ``Generator``,
``mean()``, and a dict form for YAML configs (``{"type": "lognormal", "median": 4000,
"sigma": 0.8}``). The simulator draws one value per generated sequence through a
:class:`Stream`, which draws NumPy chunks and hands out Python floats (far cheaper per
draw than either NumPy scalars or ``random``).

>>> import random
>>> Constant(value=7).sample(random.Random(0))
7.0
"""

from __future__ import annotations

import math
import random
import statistics
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from rlaxkit.rules.validation import is_number

__all__ = [
    "Constant",
    "CorrelatedLengths",
    "Distribution",
    "Empirical",
    "Lognormal",
    "LongTail",
    "Stream",
    "Uniform",
    "distribution_from_dict",
    "distribution_to_dict",
]

# z-score of the 99th percentile of a standard normal.
_Z99 = 2.3263478740408408


def _positive(name: str, value: float, *, allow_zero: bool = False) -> None:
    ok = value >= 0 if allow_zero else value > 0
    if not is_number(value) or not ok:
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name}: must be a number {bound}, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class Constant:
    """Always ``value``."""

    value: float

    def __post_init__(self) -> None:
        _positive("value", self.value, allow_zero=True)

    def sample(self, rng: random.Random) -> float:
        return float(self.value)

    def sample_many(self, generator: np.random.Generator, n: int) -> np.ndarray:
        return np.full(n, float(self.value))

    def mean(self) -> float:
        return float(self.value)


@dataclass(frozen=True, kw_only=True)
class Uniform:
    """Uniform on ``[low, high]``."""

    low: float
    high: float

    def __post_init__(self) -> None:
        _positive("low", self.low, allow_zero=True)
        if not self.high >= self.low:
            raise ValueError(f"high: must be >= low ({self.low}), got {self.high!r}")

    def sample(self, rng: random.Random) -> float:
        return rng.uniform(self.low, self.high)

    def sample_many(self, generator: np.random.Generator, n: int) -> np.ndarray:
        return generator.uniform(self.low, self.high, n)

    def mean(self) -> float:
        return 0.5 * (self.low + self.high)


@dataclass(frozen=True, kw_only=True)
class Lognormal:
    """``exp(N(log(median), sigma²))``; mean ``median · exp(sigma²/2)``."""

    median: float
    sigma: float

    def __post_init__(self) -> None:
        _positive("median", self.median)
        _positive("sigma", self.sigma, allow_zero=True)

    @classmethod
    def from_median_p99(cls, median: float, p99: float) -> Lognormal:
        """The lognormal whose median and 99th percentile are the given values."""
        if not p99 >= median > 0:
            raise ValueError(f"p99: must be >= median > 0, got median={median}, p99={p99}")
        return cls(median=median, sigma=math.log(p99 / median) / _Z99)

    @classmethod
    def fit(cls, values: Sequence[float]) -> Lognormal:
        """Maximum-likelihood fit (mean and std of the logs) to positive values."""
        logs = [math.log(v) for v in values if v > 0]
        if len(logs) < 2:
            raise ValueError("values: need at least two positive values to fit a lognormal")
        return cls(median=math.exp(statistics.fmean(logs)), sigma=statistics.pstdev(logs))

    def sample(self, rng: random.Random) -> float:
        return math.exp(rng.gauss(math.log(self.median), self.sigma))

    def sample_many(self, generator: np.random.Generator, n: int) -> np.ndarray:
        return generator.lognormal(math.log(self.median), self.sigma, n)

    def mean(self) -> float:
        return self.median * math.exp(0.5 * self.sigma**2)

    def quantile(self, q: float) -> float:
        """The ``q`` quantile, ``median · exp(sigma · Φ⁻¹(q))``."""
        return self.median * math.exp(self.sigma * statistics.NormalDist().inv_cdf(q))


@dataclass(frozen=True, kw_only=True)
class Empirical:
    """Resamples the given values uniformly (e.g. token counts read from a trace)."""

    values: tuple[float, ...] = field(repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "values", tuple(float(v) for v in self.values))
        if not self.values:
            raise ValueError("values: must be a non-empty list of numbers")
        if min(self.values) < 0:
            raise ValueError("values: must all be >= 0")

    def sample(self, rng: random.Random) -> float:
        return self.values[int(rng.random() * len(self.values))]

    def sample_many(self, generator: np.random.Generator, n: int) -> np.ndarray:
        return np.asarray(self.values)[generator.integers(0, len(self.values), n)]

    def mean(self) -> float:
        return statistics.fmean(self.values)

    def quantile(self, q: float) -> float:
        """The empirical ``q`` quantile (lower value)."""
        ordered = sorted(self.values)
        return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


@dataclass(frozen=True, kw_only=True)
class LongTail:
    """A body distribution plus a rare uniform tail: the long-tail shape of RL rollouts.

    With probability ``tail_fraction`` a draw is uniform on ``[tail_low, tail_high]``,
    otherwise it comes from ``body``. Applied Compute reports for Qwen-30B that 99% of
    samples finish in about 40 s and the last 1% need about 80 s more (``docs/papers.md``
    [AC2]); :meth:`from_latency` builds that shape in tokens.
    """

    body: Lognormal | Constant | Uniform | Empirical
    tail_fraction: float
    tail_low: float
    tail_high: float

    def __post_init__(self) -> None:
        if not 0 <= self.tail_fraction < 1:
            raise ValueError(f"tail_fraction: must be in [0, 1), got {self.tail_fraction!r}")
        _positive("tail_low", self.tail_low, allow_zero=True)
        if not self.tail_high >= self.tail_low:
            raise ValueError(f"tail_high: must be >= tail_low, got {self.tail_high!r}")

    @classmethod
    def from_latency(
        cls,
        *,
        p99_s: float,
        tail_extra_s: float,
        seconds_per_token: float,
        median_fraction: float = 0.4,
        tail_fraction: float = 0.01,
    ) -> LongTail:
        """Lengths whose p99 takes ``p99_s`` to decode and whose last ``tail_fraction``
        takes up to ``tail_extra_s`` more, at ``seconds_per_token`` per token.

        The body is a lognormal with median ``median_fraction · p99``; the tail is
        uniform between the p99 length and the length decoded in ``p99_s +
        tail_extra_s``.
        """
        p99_tokens = p99_s / seconds_per_token
        body = Lognormal.from_median_p99(median_fraction * p99_tokens, p99_tokens)
        return cls(
            body=body,
            tail_fraction=tail_fraction,
            tail_low=p99_tokens,
            tail_high=(p99_s + tail_extra_s) / seconds_per_token,
        )

    def sample(self, rng: random.Random) -> float:
        if rng.random() < self.tail_fraction:
            return rng.uniform(self.tail_low, self.tail_high)
        return self.body.sample(rng)

    def sample_many(self, generator: np.random.Generator, n: int) -> np.ndarray:
        out = self.body.sample_many(generator, n)
        tail = generator.random(n) < self.tail_fraction
        out[tail] = generator.uniform(self.tail_low, self.tail_high, int(tail.sum()))
        return out

    def mean(self) -> float:
        tail_mean = 0.5 * (self.tail_low + self.tail_high)
        return (1 - self.tail_fraction) * self.body.mean() + self.tail_fraction * tail_mean


Distribution = Constant | Uniform | Lognormal | Empirical | LongTail


class Stream:
    """A seeded stream of draws from one distribution, drawn in NumPy chunks.

    >>> stream = Stream(Constant(value=3.0), seed=0, name="demo")
    >>> stream.next(), stream.next()
    (3.0, 3.0)

    Args:
        distribution: What to draw from.
        seed: The run's seed.
        name: Names the stream, so each purpose gets its own independent draws.
        chunk: Values drawn per refill.
    """

    def __init__(self, distribution: Distribution, *, seed: int, name: str, chunk: int = 4096):
        self.distribution = distribution
        self.generator = np.random.default_rng([seed, zlib.crc32(name.encode())])
        self.chunk = chunk
        self._buffer: list[float] = []

    def next(self) -> float:
        """The next draw."""
        if not self._buffer:
            self._buffer = self.distribution.sample_many(self.generator, self.chunk).tolist()
            self._buffer.reverse()
        return self._buffer.pop()


class CorrelatedLengths:
    """Draws a group's lengths, each with the law ``distribution``, correlated by ``rho``.

    A Gaussian copula: the group draws ``z_g``, each sample ``z_i``, both standard normal;
    a sample's length is the ``Φ(√ρ·z_g + √(1−ρ)·z_i)`` quantile of ``distribution``, read
    from a sorted reference draw of ``REFERENCE_DRAWS`` values (one per quantile bin), so
    any distribution works and each sample keeps the law exactly up to that resolution.

    >>> lengths = CorrelatedLengths(Uniform(low=0, high=100), 1.0, seed=0)
    >>> len(set(lengths.group(4)))  # ρ = 1: one length per group
    1
    """

    REFERENCE_DRAWS = 1 << 16

    def __init__(self, distribution: Distribution, rho: float, *, seed: int):
        generator = np.random.default_rng([seed, zlib.crc32(b"length_reference")])
        self.reference = np.sort(distribution.sample_many(generator, self.REFERENCE_DRAWS))
        self.shared, self.own = math.sqrt(rho), math.sqrt(1.0 - rho)
        self.generator = np.random.default_rng([seed, zlib.crc32(b"length_copula")])

    def group(self, size: int) -> list[float]:
        """The lengths of one group of ``size`` samples."""
        z = self.generator.standard_normal(size + 1)
        scores = self.shared * z[0] + self.own * z[1:]
        quantiles = [0.5 * (1.0 + math.erf(score / math.sqrt(2.0))) for score in scores]
        last = len(self.reference) - 1
        return [float(self.reference[min(last, int(q * len(self.reference)))]) for q in quantiles]


_TYPES: dict[str, type] = {
    "constant": Constant,
    "uniform": Uniform,
    "lognormal": Lognormal,
    "empirical": Empirical,
    "long_tail": LongTail,
}
_NAMES = {cls: name for name, cls in _TYPES.items()}


def distribution_to_dict(dist: Distribution) -> dict[str, object]:
    """``{"type": name, **fields}``, nested for :class:`LongTail`'s body."""
    out: dict[str, object] = {"type": _NAMES[type(dist)]}
    data = asdict(dist)
    if isinstance(dist, LongTail):
        data["body"] = distribution_to_dict(dist.body)
    if isinstance(dist, Empirical):
        data["values"] = list(dist.values)
    out.update(data)
    return out


def distribution_from_dict(
    data: Mapping[str, Any] | float, *, where: str = "distribution"
) -> Distribution:
    """Parse ``{"type": ..., ...}``; a bare number means :class:`Constant`."""
    if is_number(data):
        return Constant(value=float(data))
    if not isinstance(data, Mapping) or "type" not in data:
        raise ValueError(f"{where}: must be a number or a mapping with a 'type' key")
    name = data["type"]
    if name not in _TYPES:
        raise ValueError(f"{where}.type: must be one of {sorted(_TYPES)}, got {name!r}")
    values = {k: v for k, v in data.items() if k != "type"}
    if name == "long_tail" and "body" in values:
        values["body"] = distribution_from_dict(values["body"], where=f"{where}.body")
    try:
        return _TYPES[name](**values)
    except TypeError as error:
        raise ValueError(f"{where}: bad fields for {name!r}: {error}") from None
    except ValueError as error:
        raise ValueError(f"{where}.{error}") from None
