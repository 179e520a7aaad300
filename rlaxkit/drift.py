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

``DriftProbe`` runs it on the trainer's side: rows grouped by version, the rows that hold
a version's tokens in one jitted forward pass under that version (their number rounded
up to a power of two, so a run compiles a handful of programs).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rlaxkit.batch import TrainBatch
from rlaxkit.logprobs import logprobs_from_logits
from rlaxkit.models import positions_from_mask
from rlaxkit.trainer import TrainConfig

__all__ = ["DriftProbe", "VersionReader", "drift_metrics", "make_logprob_fn"]

_LOG = logging.getLogger(__name__)
PARTS = ("staleness", "mismatch")


@runtime_checkable
class VersionReader(Protocol):
    """A parameter server that reads back any version it still retains."""

    def read(self, version: int) -> Any | None:
        """The tree pushed as ``version``, or ``None`` once evicted."""
        ...


def make_logprob_fn(cfg: TrainConfig, graphdef: nnx.GraphDef) -> Callable[..., jax.Array]:
    """Jitted ``(params, tokens, attention_mask) -> [B, T]`` log-probs, aligned as the
    batch's (entry ``t`` scores ``tokens[t]``; entry 0 is 0): the trainer's forward pass
    (its compute dtype and temperature), without gradients."""
    dtype = None if cfg.compute_dtype is None else jnp.dtype(cfg.compute_dtype)

    def cast(tree: Any) -> Any:
        if dtype is None:
            return tree
        return jax.tree.map(
            lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree
        )

    @jax.jit
    def logprobs(params: Any, tokens: jax.Array, attention_mask: jax.Array) -> jax.Array:
        model = nnx.merge(graphdef, cast(params))
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


def _bucket(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


class DriftProbe:
    """Drift attribution for the trainer: ``probe(params, batch, version)`` before the
    train step takes ``batch`` at weight ``version``.

    Args:
        cfg: the trainer's configuration (forward pass, clip range, cap).
        graphdef: the policy's graph.
        every: attribute every this many steps (0: never).
        reader: the parameter server the versions are read from (``None``: none can be).
    """

    def __init__(
        self, cfg: TrainConfig, graphdef: nnx.GraphDef, every: int, reader: Any | None
    ) -> None:
        self.every = every
        self.reader = reader if isinstance(reader, VersionReader) else None
        self.logprobs = make_logprob_fn(cfg, graphdef)
        loss = cfg.algorithm.loss
        self.clip = (loss.clip_eps_low, loss.clip_eps_high)
        self.cap = loss.behaviour_weight_cap
        self.attributed = 0
        self.skipped = 0
        self._said: set[str] = set()

    def due(self, step: int) -> bool:
        """Whether train step ``step`` (1-based) is attributed."""
        return self.every > 0 and step % self.every == 0

    def _skip(self, why: str) -> dict[str, float]:
        self.skipped += 1
        if why not in self._said:  # said once a run per reason; the count goes on
            self._said.add(why)
            _LOG.warning("drift attribution skipped a batch: %s", why)
        return {"drift/skipped_batches": float(self.skipped)}

    def __call__(self, params: Any, batch: TrainBatch, version: int) -> dict[str, float]:
        """The batch's drift metrics (``drift_metrics``) and ``drift/skipped_batches``
        (the count so far); a batch that needs a version the parameter server no longer
        holds (or a store that cannot read versions back) is skipped and counted."""
        versions = np.asarray(batch.versions)
        mask = np.asarray(batch.loss_mask) > 0
        needed = sorted({int(v) for v in np.unique(versions[mask])} - {version})
        if needed and self.reader is None:
            return self._skip(
                "this parameter server cannot read back old versions (delta or LoRA "
                "publication, or a trainer process that does not push)"
            )
        weights = {}
        for v in needed:
            found = self.reader.read(v) if self.reader is not None else None
            if found is None:
                return self._skip(
                    f"version {v} is no longer held by the parameter server (it keeps "
                    "runtime.keep_versions versions); raise keep_versions above "
                    "staleness.max_staleness to attribute every batch"
                )
            weights[v] = found
        tokens, attention = np.asarray(batch.tokens), np.asarray(batch.attention_mask)
        log_theta = np.asarray(self.logprobs(params, tokens, attention))
        log_version = log_theta.copy()  # the trainer's own version: the same weights
        for v, tree in weights.items():
            rows = np.flatnonzero(((versions == v) & mask).any(axis=1))
            # Rows repeated up to a bucket: B/8, B/4, B/2 or B, so that a batch shape
            # compiles at most four programs beside the one over every row.
            size = min(max(_bucket(rows.size), _bucket(tokens.shape[0]) // 8), tokens.shape[0])
            take = np.resize(rows, size)
            logp = np.asarray(self.logprobs(tree, tokens[take], attention[take]))[: rows.size]
            here = versions[rows] == v
            log_version[rows] = np.where(here, logp, log_version[rows])
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
