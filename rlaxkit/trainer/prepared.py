"""``PreparedBatch``: what a train step's updates train on, a ``TrainBatch`` with
everything computed before them (``rlaxkit.trainer.step``, step 1 of its docstring)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import jax


@jax.tree_util.register_dataclass
@dataclass(frozen=True, kw_only=True)
class PreparedBatch:
    """What the updates train on: a ``TrainBatch`` with everything computed before them.

    Leaves are ``[B, T]``, or ``[*chunks, B / prod(chunks), T]`` once split into
    mini- and micro-batches. ``None`` fields are empty subtrees, so ``jax.tree.map`` and
    ``lax.scan`` pass over them.

    Attributes:
        tokens, attention_mask, behaviour_logprobs, versions: the batch's.
        positions: ``positions_from_mask(attention_mask)``.
        loss_mask: the batch's, as float32, less the tokens a rollout rejection mask
            (``loss.rejection``) dropped.
        advantages: the batch's, or the advantage estimator's over the whole batch.
        returns: value targets (GAE), or ``None`` without a critic.
        old_values: critic values before any update, or ``None`` without a critic.
        ref_logprobs: the batch's, else the reference policy's when the algorithm needs
            them, else ``None``.
        proximal_logprobs: recomputed under the pre-update weights (``proximal='recompute'``
            with more than one update per step), else the batch's, else ``None``.
        token_weights: aggregation weights ``Agg`` over the mini-batch; ``None`` until
            the mini-batch's gradient sets them.
        metric_weights: ``loss_mask / Σ loss_mask`` over the mini-batch; set with
            ``token_weights``.
    """

    tokens: jax.Array
    positions: jax.Array
    attention_mask: jax.Array
    loss_mask: jax.Array
    behaviour_logprobs: jax.Array
    versions: jax.Array
    advantages: jax.Array
    returns: jax.Array | None = None
    old_values: jax.Array | None = None
    ref_logprobs: jax.Array | None = None
    proximal_logprobs: jax.Array | None = None
    token_weights: jax.Array | None = None
    metric_weights: jax.Array | None = None

    def replace(self, **changes: Any) -> PreparedBatch:
        """A copy with ``changes`` applied."""
        return dataclasses.replace(self, **changes)
