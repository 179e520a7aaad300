"""What the samplers return, and the small conversions at their boundary (model or weights,
seeds or keys).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rlaxkit.models import ModelConfig, Transformer
from rlaxkit.util.jaxutil import Packed

# A model, or its graph definition and weights (``nnx.split(model)``).
ModelLike = Transformer | tuple["nnx.GraphDef | StaticGraph", nnx.State]
# An int seed or a PRNG key (typed ``jax.random.key`` or raw ``jax.random.PRNGKey``).
KeyLike = int | jax.Array


class StaticGraph:
    """A model's graph definition as a static jit argument, hashed once.

    ``jax.jit`` hashes its static arguments on every call; an NNX ``GraphDef`` of a
    decoder takes a fraction of a millisecond to hash, which would be paid on every chunk
    of decode steps.
    """

    __slots__ = ("graphdef", "_hash", "_config")

    def __init__(self, graphdef: nnx.GraphDef):
        self.graphdef = graphdef
        self._hash = hash(graphdef)
        self._config: ModelConfig | None = None

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        return (
            isinstance(other, StaticGraph)
            and self._hash == other._hash
            and self.graphdef == other.graphdef
        )

    def merge(self, params: nnx.State | Packed) -> Transformer:
        """The model with ``params`` (inside jit: traced arrays)."""
        if isinstance(params, Packed):
            params = params.tree()
        return nnx.merge(self.graphdef, params)

    def model_config(self, params: nnx.State | Packed) -> ModelConfig:
        """The model's ``ModelConfig``, a static part of the graph: merged once, then
        remembered (a merge costs about a millisecond of Python per call)."""
        if self._config is None:
            self._config = self.merge(params).config
        return self._config


# Equal graph definitions share one ``StaticGraph``, so jit's cache lookups end at the
# identity check instead of comparing two graphs (several engines of one model).
_INTERNED: dict[int, list[StaticGraph]] = {}
_INTERN_LIMIT = 256
# The same ``GraphDef`` object passed again (a worker calling ``generate`` with the pair
# it split once) finds its ``StaticGraph`` by identity, without hashing the graph again
# (about 1.5 ms of Python for a 4-layer decoder). Holds the graph, so its id stays valid.
_BY_ID: dict[int, tuple[nnx.GraphDef, StaticGraph]] = {}


def _intern(graph: StaticGraph) -> StaticGraph:
    bucket = _INTERNED.setdefault(hash(graph), [])
    for known in bucket:
        if known.graphdef == graph.graphdef:
            return known
    if sum(len(b) for b in _INTERNED.values()) >= _INTERN_LIMIT:
        _INTERNED.clear()
        bucket = _INTERNED.setdefault(hash(graph), [])
    bucket.append(graph)
    return graph


def split_model(model: ModelLike) -> tuple[StaticGraph, nnx.State]:
    """``(graph, params)`` of a ``Transformer`` or of an already split pair."""
    graph: nnx.GraphDef | StaticGraph
    if isinstance(model, nnx.Module):
        graph, params = nnx.split(model)
    else:
        graph, params = model
    if not isinstance(graph, StaticGraph):
        known = _BY_ID.get(id(graph))
        if known is not None and known[0] is graph:
            return known[1], params
        if len(_BY_ID) >= _INTERN_LIMIT:
            _BY_ID.clear()
        static = _intern(StaticGraph(graph))
        _BY_ID[id(graph)] = (graph, static)
        graph = static
    return graph, params


def packed(params: nnx.State | Packed) -> Packed:
    """``params`` as the programs take them: flattened once (``rlaxkit.util.jaxutil.Packed``),
    instead of once in every program call of a ``generate`` or an engine's chunk."""
    return params if isinstance(params, Packed) else Packed.of(params)


def matching_params(
    weights: ModelLike | nnx.State, graph: StaticGraph, current: Packed
) -> tuple[nnx.State, Packed]:
    """The parameters of ``weights`` (a ``Transformer``, ``(graphdef, params)`` or the
    parameters alone), checked to fit a model of graph ``graph`` whose current
    parameters are ``current``: same architecture, tree structure, shapes and dtypes.
    Returns them as a tree and packed (flattened once: a worker takes new weights every
    step).

    Raises:
        ValueError: naming the first mismatch.
    """
    if isinstance(weights, nnx.Module) or (
        isinstance(weights, tuple) and isinstance(weights[0], nnx.GraphDef | StaticGraph)
    ):
        new_graph, new_params = split_model(weights)
        if new_graph != graph:
            raise ValueError("new weights have a different model architecture")
    else:
        new_params = weights
    new = packed(new_params)
    if isinstance(new_params, Packed):  # the tree is what the engine keeps as its params
        new_params = new.tree()
    if new.structure is not current.structure:  # interned: one structure, one object
        raise ValueError("new weights do not have the structure of the current ones")
    for i, (leaf, old) in enumerate(zip(new.leaves, current.leaves, strict=True)):
        if leaf.shape != old.shape or leaf.dtype != old.dtype:
            path, _ = jax.tree.leaves_with_path(new_params)[i]
            raise ValueError(
                f"new weight {jax.tree_util.keystr(path)} is {leaf.dtype}{list(leaf.shape)}, "
                f"expected {old.dtype}{list(old.shape)}"
            )
    return new_params, new


def _seed_key_data(seed: int) -> np.ndarray | None:
    """``key_data(jax.random.key(seed))`` computed on the host, where its layout is
    known (default threefry keys, 32-bit mode, ``0 <= seed < 2**31``: ``[0, seed]``);
    ``None`` elsewhere. Saves an eager device round trip per submitted request."""
    # jax.config's flags are attributes set at run time; mypy cannot see them.
    if (
        0 <= seed < 2**31
        and jax.config.jax_default_prng_impl == "threefry2x32"  # type: ignore[attr-defined]
        and not jax.config.jax_enable_x64  # type: ignore[attr-defined]
    ):
        return np.array([0, seed], np.uint32)
    return None


def key_data(rng: KeyLike) -> np.ndarray:
    """The uint32 data of one PRNG key given as a seed or a key (host array)."""
    if isinstance(rng, int | np.integer):
        data = _seed_key_data(int(rng))
        if data is not None:
            return data
        rng = jax.random.key(int(rng))
    if jnp.issubdtype(rng.dtype, jax.dtypes.prng_key):
        if rng.shape != ():
            raise ValueError(f"expected one PRNG key, got an array of shape {rng.shape}")
        return np.asarray(jax.random.key_data(rng))
    data = np.asarray(rng)
    if data.dtype != np.uint32 or data.ndim != 1:
        raise ValueError(f"expected a seed or a PRNG key, got {data.dtype}{list(data.shape)}")
    return data


def _rotate_left(x: np.ndarray, bits: int) -> np.ndarray:
    return (x << np.uint32(bits)) | (x >> np.uint32(32 - bits))


def threefry_fold_in(key: np.ndarray, data: np.ndarray) -> np.ndarray:
    """``key_data(fold_in(wrap_key_data(key), d))`` for every ``d`` in ``data``, on the host.

    JAX's default key is threefry-2x32: ``fold_in(key, d)`` is the Threefry-2x32 hash
    (Salmon et al. 2011, 20 rounds, rotations 13 15 26 6 / 17 29 16 24, key schedule
    ``k0, k1, k0 ^ k1 ^ 0x1BD11BDA``) of the counter pair ``(0, d)`` under ``key``.
    Computed in numpy it costs microseconds, where one eager ``fold_in`` per prompt is a
    device dispatch each; ``tests/test_sampling.py`` checks it against ``jax.random``.

    Args:
        key: ``[2]`` uint32 key data.
        data: ``[N]`` non-negative integers below ``2**32``.

    Returns:
        ``[N, 2]`` uint32 key data.
    """
    k0, k1 = np.uint32(key[0]), np.uint32(key[1])
    schedule = (k0, k1, k0 ^ k1 ^ np.uint32(0x1BD11BDA))
    rotations = ((13, 15, 26, 6), (17, 29, 16, 24))
    with np.errstate(over="ignore"):
        x0 = np.zeros(len(data), np.uint32) + schedule[0]
        x1 = np.asarray(data, np.uint32) + schedule[1]
        for i in range(5):
            for r in rotations[i % 2]:
                x0 = x0 + x1
                x1 = _rotate_left(x1, r) ^ x0
            x0 = x0 + schedule[(i + 1) % 3]
            x1 = x1 + schedule[(i + 2) % 3] + np.uint32(i + 1)
    return np.stack([x0, x1], axis=1)


def _host_threefry() -> bool:
    """Keys are threefry-2x32 in 32-bit mode, the layout ``threefry_fold_in`` computes."""
    # jax.config's flags are attributes set at run time; mypy cannot see them.
    return (
        jax.config.jax_default_prng_impl == "threefry2x32"  # type: ignore[attr-defined]
        and not jax.config.jax_enable_x64  # type: ignore[attr-defined]
    )


def prompt_keys(rng: KeyLike | Sequence[KeyLike], num_prompts: int) -> np.ndarray:
    """``[num_prompts, ...]`` key data: ``rng[i]`` per prompt, or ``fold_in(rng, i)``."""
    if isinstance(rng, Sequence):
        if len(rng) != num_prompts:
            raise ValueError(f"got {len(rng)} keys for {num_prompts} prompts")
        return np.stack([key_data(r) for r in rng])
    data = key_data(rng)
    if _host_threefry() and data.shape == (2,):
        return threefry_fold_in(data, np.arange(num_prompts))
    base = jax.random.wrap_key_data(jnp.asarray(data))
    return np.stack(
        [np.asarray(jax.random.key_data(jax.random.fold_in(base, i))) for i in range(num_prompts)]
    )


@dataclass(frozen=True, init=False)
class Completion:
    """One sampled completion of one request.

    Attributes:
        request_id: the request (prompt) it answers.
        sample_index: which of the request's ``n`` samples it is.
        prompt_tokens: ``[P]`` int32, the context the completion follows: the prompt,
            and for a resumed turn every earlier turn and observation after it.
        tokens: ``[C]`` int32, up to and including a stop token or stop sequence.
        logprobs: ``[C]`` float32 behaviour log-probs, under the (truncated) distribution
            each token was drawn from.
        plain_logprobs: ``[C]`` float32, under ``softmax(logits / temperature)`` without
            truncation: what the trainer recomputes (equal to ``logprobs`` when no top-k,
            top-p or min-p is set).
        versions: ``[C]`` int32 weight version that produced each token.
        finish_reason: ``"stop"``, ``"length"`` or ``"interrupted"``.
        parked: the engine holds the row, cache and all, for ``InferenceEngine.resume``
            (a ``hold`` request stopped by a stop sequence).
    """

    request_id: int
    sample_index: int
    prompt_tokens: np.ndarray
    tokens: np.ndarray
    logprobs: np.ndarray
    plain_logprobs: np.ndarray
    versions: np.ndarray
    finish_reason: str
    parked: bool = False

    def __init__(
        self,
        request_id: int,
        sample_index: int,
        prompt_tokens: np.ndarray,
        tokens: np.ndarray,
        logprobs: np.ndarray,
        plain_logprobs: np.ndarray,
        versions: np.ndarray,
        finish_reason: str,
        parked: bool = False,
    ) -> None:
        # Into the instance's dict at once (an engine builds one a sample): 1.0 us
        # against a frozen dataclass's 1.7 us, one object.__setattr__ a field.
        self.__dict__.update(
            request_id=request_id,
            sample_index=sample_index,
            prompt_tokens=prompt_tokens,
            tokens=tokens,
            logprobs=logprobs,
            plain_logprobs=plain_logprobs,
            versions=versions,
            finish_reason=finish_reason,
            parked=parked,
        )

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)


@dataclass(frozen=True)
class GenerationResult:
    """Completions of ``B`` prompts, ``n`` samples each, padded to ``M`` tokens.

    Entries after a completion's end are 0 (versions -1) and ``mask`` is False there.

    Attributes:
        tokens: ``[B, n, M]`` int32.
        logprobs: ``[B, n, M]`` float32 behaviour log-probs (sampled distribution).
        plain_logprobs: ``[B, n, M]`` float32 temperature-only log-probs.
        versions: ``[B, n, M]`` int32 weight versions.
        mask: ``[B, n, M]`` bool, the token is part of the completion.
        lengths: ``[B, n]`` int32 completion lengths.
        finish_reasons: ``B`` tuples of ``n`` reasons (``"stop"`` or ``"length"``).
        prompts: the ``B`` prompts, int32 arrays.
    """

    tokens: np.ndarray
    logprobs: np.ndarray
    plain_logprobs: np.ndarray
    versions: np.ndarray
    mask: np.ndarray
    lengths: np.ndarray
    finish_reasons: tuple[tuple[str, ...], ...]
    prompts: tuple[np.ndarray, ...]

    def completion(self, prompt: int, sample: int = 0) -> Completion:
        """Sample ``sample`` of prompt ``prompt``, cut to its length."""
        length = int(self.lengths[prompt, sample])
        return Completion(
            request_id=prompt,
            sample_index=sample,
            prompt_tokens=self.prompts[prompt],
            tokens=self.tokens[prompt, sample, :length],
            logprobs=self.logprobs[prompt, sample, :length],
            plain_logprobs=self.plain_logprobs[prompt, sample, :length],
            versions=self.versions[prompt, sample, :length],
            finish_reason=self.finish_reasons[prompt][sample],
        )

    def completions(self) -> list[list[Completion]]:
        """Every completion, ``[prompt][sample]``."""
        b, n = self.lengths.shape
        return [[self.completion(i, j) for j in range(n)] for i in range(b)]
