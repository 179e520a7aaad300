"""``PackedTrainStep``: the jitted train step ``rlaxkit.trainer.step.make_train_step``
returns, and how a ``TrainState`` crosses ``jax.jit`` in it.

A state's fields cross the jitted function packed (``rlaxkit.util.jaxutil.Packed``): each
field's tree flattened once, its structure interned, so the call flattens one Python
object per field and keys its cache by an identity test instead of comparing every
``nnx.Variable`` of the parameters and optimizer state. The packing is the step's own:
it takes and returns a plain ``TrainState``, and remembers the packed fields of the state
it returned last (while that state lives), so passing it to the next call flattens
nothing. A state built anew (``replace``, a restored checkpoint) is packed field by field;
a field that a ``Packed`` rebuilt (the parameters a step returned) packs back to it
without a flatten. docs/performance.md has the measurements.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable

import jax

from rlaxkit.data.batch import TrainBatch
from rlaxkit.observe.drift import DriftProbe
from rlaxkit.trainer.state import TrainState
from rlaxkit.util.jaxutil import Packed, TieredJit

_NAMES = tuple(f.name for f in dataclasses.fields(TrainState))
_PARAMS = _NAMES.index("params")

StepFunction = Callable[
    [TrainState, TrainBatch], tuple[TrainState, dict[str, jax.Array], jax.Array | None]
]


def _fields(state: TrainState) -> tuple[Packed, ...]:
    """Each field of ``state`` packed (a tree ``Packed.tree`` built packs back to its own)."""
    return tuple(Packed.of(getattr(state, name)) for name in _NAMES)


def _state(fields: tuple[Packed, ...]) -> TrainState:
    """The state whose fields are ``fields``, rebuilt (inside the jitted function)."""
    return TrainState(*(p.structure.treedef.unflatten(p.leaves) for p in fields))


class PackedTrainStep:
    """``make_train_step``'s jitted ``train_step(state, batch) -> (state, metrics)``.

    The state crosses the jitted function packed, parameters apart from the other
    fields, so that ``keep_params`` donates every buffer but theirs. ``jitted`` is the
    ``jax.jit`` (or ``TieredJit``) function of the packed arguments. ``drift``
    attributes the drift of the batches it is due on, under the weights the step starts
    from, and adds its ``drift/*`` metrics (floats) to the step's; it reads old versions
    from ``drift.reader``, which the caller sets. ``train_step`` returns
    ``(state, metrics, log_theta)``: with ``step_logprobs``, ``log_theta`` is the batch's
    ``[B, T]`` log-probs under the weights it starts from (its one update's forward pass,
    or the recomputed proximal log-probs), which the attribution then takes after the
    step instead of its own forward pass before it; otherwise ``None``.
    """

    def __init__(
        self,
        train_step: StepFunction,
        *,
        donate: bool,
        keep_params: bool,
        tiered: bool,
        drift: DriftProbe | None = None,
        step_logprobs: bool = False,
    ):
        self.drift = drift or DriftProbe.off()
        self.step_logprobs = step_logprobs
        # The state this step returned last (a weak reference) and its packed fields.
        self._last: tuple[weakref.ref[TrainState], tuple[Packed, ...]] | None = None

        def packed_step(
            params: Packed, rest: tuple[Packed, ...], batch: TrainBatch
        ) -> tuple[tuple[Packed, ...], dict[str, jax.Array], jax.Array | None]:
            state, metrics, log_theta = train_step(
                _state((*rest[:_PARAMS], params, *rest[_PARAMS:])), batch
            )
            return _fields(state), metrics, log_theta

        donate_argnums = ((1,) if keep_params else (0, 1)) if donate else ()
        jit = TieredJit if tiered else jax.jit
        self.jitted = jit(packed_step, donate_argnums=donate_argnums)

    def _pack(self, state: TrainState) -> tuple[Packed, ...]:
        """``state``'s fields packed: those this step remembers for it, else each field's."""
        last = self._last
        if last is not None and last[0]() is state:
            return last[1]
        return _fields(state)

    def _arguments(self, state: TrainState) -> tuple[Packed, tuple[Packed, ...]]:
        fields = self._pack(state)
        return fields[_PARAMS], fields[:_PARAMS] + fields[_PARAMS + 1 :]

    def _returned(self, fields: tuple[Packed, ...]) -> TrainState:
        """The plain state of a call's packed output, remembered with it while it lives."""
        state = TrainState(*(p.tree() for p in fields))

        def forget(ref: weakref.ref[TrainState]) -> None:
            if self._last is not None and self._last[0] is ref:
                self._last = None

        self._last = (weakref.ref(state, forget), fields)
        return state

    def __call__(
        self, state: TrainState, batch: TrainBatch
    ) -> tuple[TrainState, dict[str, jax.Array]]:
        version = int(state.step) if self.step_logprobs else None
        if version is None or not self.drift.due(version + 1):
            # Attribution off (the default): the probe is not called at all.
            drift = {}
            if self.drift.every:
                drift = self.drift.attribute(state.params, batch, state.step)
            fields, metrics, _ = self.jitted(*self._arguments(state), batch)
            return self._returned(fields), metrics | drift
        # The step may donate the state's buffers: the layout and the version only.
        params, rest = self._arguments(state)
        fields, metrics, log_theta = self.jitted(params, rest, batch)
        jax.block_until_ready(log_theta)  # the step's time, not the attribution's
        drift = self.drift.attribute(params, batch, version, log_theta=log_theta)
        return self._returned(fields), metrics | drift

    def lower(self, state: TrainState, batch: TrainBatch) -> jax.stages.Lowered:
        """Lowers the jitted step for these arguments (``jax.jit(...).lower``)."""
        return self.jitted.lower(*self._arguments(state), batch)

    def wait(self) -> None:
        """Tiered: blocks until the optimised compiles started so far are done
        (``TieredJit.wait``); otherwise returns at once."""
        if isinstance(self.jitted, TieredJit):
            self.jitted.wait()
