"""Drift attribution: how much of the importance ratio π_θ / μ is staleness, how much is
engine mismatch.

A token sampled by weight version ``v`` with behaviour log-prob ``log μ`` (what the
sampler recorded) is trained by weights ``θ`` (the trainer's version, ``v`` or newer).
Its log-ratio splits exactly in two::

    log π_θ − log μ  =  (log π_θ − log π_v)  +  (log π_v − log μ)
                          staleness             mismatch

``log π_v`` is the trainer's own forward pass under the weights of version ``v``, read back
from the parameter server (which keeps the newest ``runtime.keep_versions``). Staleness
is what the weights moved since the token was sampled; mismatch is what the sampler and
the trainer compute differently for the same weights (precision, kernels, a cache). A
token sampled by the trainer's own version has staleness exactly 0 (the same weights, the
same forward pass).

For each part ``d`` (per loss token) ``drift_metrics`` reports the mean ``|d|``, the k3
estimate of the KL divergence, ``E[(r − 1) − log r]`` with ``r = exp(d)`` (Schulman's
low-variance estimator, always ``>= 0``), the share of tokens whose ratio ``r`` alone
falls outside the PPO clip range ``[1 − ε_low, 1 + ε_high]`` and the share above the
behaviour-weight cap ``C`` (what ``behaviour_weight='mask'`` would drop).

``DriftProbe`` runs it on the trainer's side (``rlaxkit.trainer.state.PackedTrainStep`` calls
it on each step it is due on, ``TrainConfig.drift_every``). ``log π_θ`` is the train
step's own, under the weights it starts from (the forward pass of its one update, or its
recomputed proximal log-probs; a step with several updates and no recompute has neither,
and the probe then runs that forward pass itself before the step). For each older
version, the rows that hold its tokens go through one jitted forward pass under it
(their number rounded up to a power of two, so a run compiles a handful of programs).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rlaxkit.data.batch import TrainBatch
from rlaxkit.models import positions_from_mask
from rlaxkit.trainer.logprobs import logprobs_from_logits
from rlaxkit.util.jaxutil import Packed, cast_floats

if TYPE_CHECKING:  # both import this module's users; annotations only
    from rlaxkit.config.run import RunConfig
    from rlaxkit.trainer.config import TrainConfig

__all__ = [
    "DriftProbe",
    "VersionReader",
    "drift_metrics",
    "make_logprob_fn",
    "sampler_config",
]

_LOG = logging.getLogger(__name__)
PARTS = ("staleness", "mismatch")


@runtime_checkable
class VersionReader(Protocol):
    """A parameter server that reads back any version it still retains."""

    def read(self, version: int) -> object | None:
        """The tree pushed as ``version``, or ``None`` once evicted."""
        ...


def make_logprob_fn(cfg: TrainConfig, graphdef: nnx.GraphDef) -> Callable[..., jax.Array]:
    """Jitted ``(params, tokens, attention_mask) -> [B, T]`` log-probs, aligned as the
    batch's (entry ``t`` scores ``tokens[t]``; entry 0 is 0): the trainer's forward pass
    (its compute dtype and temperature), without gradients. ``params`` is a tree or its
    ``rlaxkit.util.jaxutil.Packed`` (a call then flattens nothing)."""

    @jax.jit
    def logprobs(params: object, tokens: jax.Array, attention_mask: jax.Array) -> jax.Array:
        if isinstance(params, Packed):
            params = params.structure.treedef.unflatten(params.leaves)
        model = nnx.merge(graphdef, cast_floats(params, cfg.compute_dtype))
        positions = positions_from_mask(attention_mask)
        hidden = model.hidden_states(tokens, positions, attention_mask)[:, :-1]
        logp = logprobs_from_logits(model.unembed(hidden), tokens[:, 1:], cfg.temperature)
        return jnp.pad(logp, ((0, 0), (1, 0)))

    return logprobs


def drift_metrics(
    log_theta: np.ndarray,
    log_version: np.ndarray,
    behaviour: np.ndarray,
    mask: np.ndarray,
    *,
    clip_low: float,
    clip_high: float,
    cap: float,
    lag: np.ndarray | None = None,
) -> dict[str, float]:
    """Staleness and mismatch statistics over the tokens where ``mask`` is set; with
    ``lag`` (per token: trainer version − sampling version), the mean ``|staleness|`` of
    the tokens of each lag ``k`` as ``drift/staleness/lag_<k>``.

    >>> theta, v, mu = np.log([[0.5, 0.5]]), np.log([[0.5, 0.25]]), np.log([[0.5, 0.25]])
    >>> out = drift_metrics(theta, v, mu, np.ones((1, 2)), clip_low=0.2, clip_high=0.2, cap=2)
    >>> round(out["drift/staleness/abs_mean"], 4), out["drift/staleness/clipped_share"]
    (0.3466, 0.5)
    >>> out["drift/mismatch/abs_mean"], out["drift/mismatch/k3"]
    (0.0, 0.0)

    Returns:
        ``drift/<part>/abs_mean``, ``/k3``, ``/clipped_share``, ``/masked_share`` for
        ``staleness`` (``log_theta − log_version``) and ``mismatch`` (``log_version −
        behaviour``), and ``drift/tokens``.
    """
    keep = np.asarray(mask, bool)
    tokens = int(keep.sum())
    out: dict[str, float] = {"drift/tokens": float(tokens)}
    parts = {
        "staleness": (np.asarray(log_theta) - np.asarray(log_version))[keep],
        "mismatch": (np.asarray(log_version) - np.asarray(behaviour))[keep],
    }
    for name, d in parts.items():
        d = d.astype(np.float64)
        # exp of a clipped-away log-ratio may overflow; its share and k3 stay finite.
        ratio = np.exp(np.clip(d, -50.0, 50.0))
        denominator = max(tokens, 1)
        out[f"drift/{name}/abs_mean"] = float(np.abs(d).sum() / denominator)
        out[f"drift/{name}/k3"] = float(((ratio - 1.0) - d).sum() / denominator)
        clipped = (ratio < 1.0 - clip_low) | (ratio > 1.0 + clip_high)
        out[f"drift/{name}/clipped_share"] = float(clipped.sum() / denominator)
        out[f"drift/{name}/masked_share"] = float((ratio > cap).sum() / denominator)
    if lag is not None:
        lags, staleness = np.asarray(lag)[keep], np.abs(parts["staleness"])
        for k in np.unique(lags):
            out[f"drift/staleness/lag_{int(k)}"] = float(staleness[lags == k].mean())
    return out


def sampler_config(config: RunConfig) -> RunConfig:
    """``config`` with its model built in ``model.sampler_dtype``: the workers' graph."""
    spec = dataclasses.replace(config.model, param_dtype=config.model.sampler_dtype)
    return dataclasses.replace(config, model=spec)


def _packed(tree: object) -> Packed:
    return tree if isinstance(tree, Packed) else Packed.of(tree)


def _bucket(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


class DriftProbe:
    """Drift attribution for the trainer: ``attribute(params, batch, version)`` before
    the train step that takes ``batch`` at weight ``version``
    (``rlaxkit.trainer.state.PackedTrainStep`` calls it).

    Args:
        cfg: the trainer's configuration (forward pass, clip range, cap).
        graphdef: the policy's graph.
        every: attribute every this many steps (0: never).
        reader: the parameter server old versions are read from (``None``, or one that
            cannot read versions back: every batch that needs one is skipped); the
            trainer sets it once it has connected to its store.
    """

    def __init__(
        self, cfg: TrainConfig | None, graphdef: nnx.GraphDef | None, every: int, reader: object
    ) -> None:
        self.every = every
        self.reader = reader
        self.logprobs: Callable[..., jax.Array] | None = None
        self.clip, self.cap = (0.2, 0.2), 2.0
        if cfg is not None and graphdef is not None and every > 0:
            self.logprobs = make_logprob_fn(cfg, graphdef)
            loss = cfg.algorithm.loss
            self.clip = (loss.clip_eps_low, loss.clip_eps_high)
            self.cap = loss.behaviour_weight_cap
        self.attributed = 0
        self.skipped = 0
        self._said: set[str] = set()

    @classmethod
    def off(cls) -> DriftProbe:
        """A probe that never attributes."""
        return cls(None, None, 0, None)

    @property
    def reader(self) -> VersionReader | None:
        """The parameter server versions are read from, if it can read them back."""
        return self._reader

    @reader.setter
    def reader(self, server: object) -> None:
        self._reader = server if isinstance(server, VersionReader) else None

    def due(self, step: int) -> bool:
        """Whether train step ``step`` (1-based) is attributed."""
        return self.every > 0 and step % self.every == 0

    def attribute(
        self, params: object, batch: TrainBatch, version: int | jax.Array, log_theta: object = None
    ) -> dict[str, float]:
        """When the step after weight ``version`` (an int or a scalar array) is due,
        the drift of ``batch`` under ``params`` (``__call__``) with ``drift/seconds``,
        what it took; otherwise ``{}``."""
        if self.every == 0 or not self.due(int(version) + 1):
            return {}
        start = time.perf_counter()
        metrics = self(params, batch, int(version), log_theta=log_theta)
        return metrics | {"drift/seconds": time.perf_counter() - start}

    def _skip(self, why: str) -> dict[str, float]:
        self.skipped += 1
        if why not in self._said:  # said once a run per reason; the count goes on
            self._said.add(why)
            _LOG.warning("drift attribution skipped a batch: %s", why)
        return {"drift/skipped_batches": float(self.skipped)}

    def __call__(
        self, params: object, batch: TrainBatch, version: int, *, log_theta: object = None
    ) -> dict[str, float]:
        """The batch's drift metrics (``drift_metrics``) and ``drift/skipped_batches``
        (the count so far); a batch that needs a version the parameter server no longer
        holds (or a store that cannot read versions back) is skipped and counted.

        ``params`` are the weights of ``version`` (a tree or its ``Packed``), and
        ``log_theta`` the batch's ``[B, T]`` log-probs under them: the train step's own
        (``PackedTrainStep``; ``params`` then gives only the layout), or ``None``, a
        forward pass here."""
        if self.logprobs is None:
            raise ValueError("this DriftProbe is off (every=0): it attributes nothing")
        versions = np.asarray(batch.versions)
        mask = np.asarray(batch.loss_mask) > 0
        needed = sorted({int(v) for v in np.unique(versions[mask])} - {version})
        reader = self.reader
        if needed and reader is None:
            return self._skip(
                "this parameter server cannot read back old versions (delta or LoRA "
                "publication, or a trainer process that does not push)"
            )
        weights, layout = {}, _packed(params).structure
        for v in needed:
            found = reader.read(v) if reader is not None else None
            if found is None:
                return self._skip(
                    f"version {v} is no longer held by the parameter server (it keeps "
                    "runtime.keep_versions versions); raise keep_versions above "
                    "staleness.max_staleness to attribute every batch"
                )
            found = Packed.of(found)  # flattened once; jit then flattens nothing
            if found.structure != layout:
                return self._skip(
                    "the parameter server hands versions back in another tree layout than "
                    "the trainer's parameters (split or delta records)"
                )
            weights[v] = found
        tokens, attention = np.asarray(batch.tokens), np.asarray(batch.attention_mask)
        if log_theta is None:
            log_theta = self.logprobs(_packed(params), tokens, attention)
        log_theta = np.asarray(log_theta)
        log_version = log_theta.copy()  # the trainer's own version: the same weights
        pending = []  # every version's forward pass dispatched before any is read back
        for v, tree in weights.items():
            rows = np.flatnonzero(((versions == v) & mask).any(axis=1))
            # Rows repeated up to a bucket: B/8, B/4, B/2 or B, so that a batch shape
            # compiles at most four programs (and the one over every row, without the
            # step's log π_θ).
            size = min(max(_bucket(rows.size), _bucket(tokens.shape[0]) // 8), tokens.shape[0])
            take = np.resize(rows, size)
            pending.append((v, rows, self.logprobs(tree, tokens[take], attention[take])))
        for v, rows, logp in pending:
            here = versions[rows] == v
            log_version[rows] = np.where(here, np.asarray(logp)[: rows.size], log_version[rows])
        self.attributed += 1
        metrics = drift_metrics(
            log_theta,
            log_version,
            np.asarray(batch.behaviour_logprobs),
            mask,
            clip_low=self.clip[0],
            clip_high=self.clip[1],
            cap=self.cap,
            lag=version - versions,
        )
        return {**metrics, "drift/skipped_batches": float(self.skipped)}
