"""A parameter server on Ray's object store: put once, many zero-copy gets per host.

The trainer ``ray.put``\\ s each version's host arrays **once**, in its own process, and
registers the resulting ``ObjectRef`` with a small :class:`ParameterServerActor` that
keeps the newest ``keep`` versions. A worker asks the actor for the newest reference and
``ray.get``\\ s it: on the trainer's host that maps the shared-memory object store
(``numpy`` views, no copy); on another host Ray moves the object once to that host's store
and every worker there shares it. The actor only holds references, never bytes, so it
stays light and a slow reader never blocks a push.

**Ownership and failures.** Ray makes the process that called ``ray.put`` the owner of
the object, so the weights live as long as the trainer does:

- the *actor* may die and be restarted by Ray (``max_restarts``); it comes back empty
  and the trainer registers its newest reference again (:meth:`republish`, no new put);
- the *trainer* may die: its objects go with it. Readers then get
  :class:`WeightsLostError`, and the restarted trainer publishes afresh with
  ``reset=True``, which forgets the dead references.

Ray dropped ``ray.put(..., _owner=...)`` (2.56), which would have let the actor own the
objects; a copy into an actor-owned object would cost a second full copy per version.

**Speed: start the cluster with** :data:`RAY_SYSTEM_CONFIG`. A push is one copy into
the object store's shared memory, at memory speed *if that memory was written before*.
The first write to a shared-memory page costs a page fault that allocates and zeroes it
(on the 2-core test machine, 256 MB of fresh pages took 0.1-1 s, against 35 ms for
the same copy into pages used before). Ray hands back an evicted version's memory only
when its raylet flushes the objects that went out of scope, by default once a second
(``free_objects_period_milliseconds``); until the store is full, pushes less than a
second apart therefore land on fresh pages every time. With the flush immediate, each
push reuses the pages of the version it evicted, and after ``keep + 1`` pushes every
push is a copy into warm memory. Pass the setting to the cluster's start, e.g.
``ray.init(_system_config=RAY_SYSTEM_CONFIG)``, or
``RAY_free_objects_period_milliseconds=0 ray start ...`` on every host. Size
``object_store_memory`` for at least ``keep + 1`` versions plus one per reader that
holds an older one; beyond that Ray spills to disk.

On a running Ray cluster (a literal block, not a doctest: it needs one; the Ray tests
run the same calls)::

    import numpy as np
    actor = parameter_server_actor(keep=2)
    trainer_side = RayObjectStoreParameterServer(actor)
    trainer_side.push(1, {"w": np.ones(3)})
    RayObjectStoreParameterServer(actor).pull(min_version=1)[0]  # 1
"""

from __future__ import annotations

import collections
import contextlib
import os
import shutil
import tempfile
import time
from collections.abc import Iterator, Mapping
from typing import Any, TypeAlias

import jax
import ray
from ray.exceptions import ObjectLostError

from rlaxkit.param_server.base import (
    EventHook,
    TransferRecord,
    TransferStats,
    check_keep,
    check_new_version,
    pull_timeout_error,
    record_transfer,
    tree_nbytes,
)
from rlaxkit.rules.validation import check_int

__all__ = [
    "RAY_SYSTEM_CONFIG",
    "ParameterServerActor",
    "RayObjectStoreParameterServer",
    "WeightsLostError",
    "local_cluster",
    "parameter_server_actor",
]

# A Ray handle to a ParameterServerActor. Ray types the methods of a plain ``ActorHandle``
# as ``Never``, and its typed handles (``ActorProxy`` with ``@ray.method``) take no
# default arguments and make the methods uncallable in-process, so the remote calls
# through a handle go unchecked.
ParameterServerHandle: TypeAlias = Any

RAY_SYSTEM_CONFIG: dict[str, object] = {"free_objects_period_milliseconds": 0}
"""Ray system config under which pushes reuse evicted versions' memory at once (see the
module docstring); ``ray.init(_system_config=RAY_SYSTEM_CONFIG)``."""


@contextlib.contextmanager
def local_cluster(
    num_cpus: int = 2, *, system_config: Mapping[str, object] | None = RAY_SYSTEM_CONFIG
) -> Iterator[None]:
    """A Ray cluster on this machine for the life of the block, as tests and benchmarks
    start one: ``num_cpus`` logical CPUs, no dashboard, workers' logs kept from the
    driver, ``system_config`` (default ``RAY_SYSTEM_CONFIG``; ``None``: Ray's own), and
    a short session directory (Ray's socket paths must fit in 107 bytes), removed at the
    end. Ray's token authentication is off unless ``RAY_AUTH_MODE`` says otherwise (it
    would write a token under the home directory)."""
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    temp_dir = tempfile.mkdtemp(prefix="ray-")
    ray.init(
        num_cpus=num_cpus,
        include_dashboard=False,
        log_to_driver=False,
        _temp_dir=temp_dir,
        _system_config=None if system_config is None else dict(system_config),
    )
    try:
        yield
    finally:
        ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)


class WeightsLostError(RuntimeError):
    """The newest version's object is gone (its owner, the trainer, died).

    The version stays registered until the restarted trainer publishes again; a reader
    should keep its current weights and try again later.
    """


class ParameterServerActor:
    """The actor's body: the newest ``keep`` versions as object references.

    A plain class (usable without Ray in tests); :func:`parameter_server_actor` starts
    it as an actor. References are passed wrapped in a list so Ray hands the actor the
    reference itself, not the object's value.
    """

    def __init__(self, keep: int = 2) -> None:
        self.keep = check_keep(keep)
        self._versions: collections.OrderedDict[int, tuple[ray.ObjectRef, int]] = (
            collections.OrderedDict()
        )
        self._pinned: int | None = None
        self.registrations = 0

    def register(
        self,
        version: int,
        ref: list[ray.ObjectRef],
        nbytes: int,
        reset: bool = False,
        pin: bool = False,
        after: int | None = None,
    ) -> bool:
        """Publishes ``ref[0]`` as ``version``; ``reset`` first forgets every version
        (their owner died), so ``version`` need only be new to an empty store; ``pin``
        keeps it beyond the ``keep`` newest until the next pinned one (a LoRA run's
        base record, ``adapters``). ``after`` is the version the caller registered
        last: an actor that holds no version then has restarted empty since, and
        registers nothing (``False``), so that the caller can register what it retains
        first (:meth:`RayObjectStoreParameterServer.push`)."""
        if reset:
            self._versions.clear()
            self._pinned = None
        elif after is not None and not self._versions:
            return False
        check_new_version(version, self.latest_version())
        self._versions[int(version)] = (ref[0], int(nbytes))
        if pin:
            self._pinned = int(version)
        unpinned = [v for v in self._versions if v != self._pinned]
        for old in unpinned[: max(0, len(unpinned) - self.keep)]:
            del self._versions[old]  # Dropping the reference frees the object.
        self.registrations += 1
        return True

    def latest(self, min_version: int | None = None) -> tuple[int, list[ray.ObjectRef], int] | None:
        """``(version, [ref], nbytes)`` of the newest version if it is ``>= min_version``."""
        version = self.latest_version()
        if version is None or (min_version is not None and version < min_version):
            return None
        ref, nbytes = self._versions[version]
        return version, [ref], nbytes

    def ref(self, version: int) -> list[ray.ObjectRef] | None:
        """``[ref]`` of ``version`` if it is retained, else ``None``."""
        entry = self._versions.get(int(version))
        return None if entry is None else [entry[0]]

    def latest_version(self) -> int | None:
        """The newest registered version, or ``None`` (also right after a restart)."""
        return next(reversed(self._versions), None)

    def versions(self) -> list[int]:
        """Versions retained, oldest first."""
        return list(self._versions)


def parameter_server_actor(
    keep: int = 2,
    *,
    num_cpus: float = 0,
    max_restarts: int = 3,
    resources: dict[str, float] | None = None,
    name: str | None = None,
) -> ParameterServerHandle:
    """Starts a :class:`ParameterServerActor` that Ray restarts up to ``max_restarts``
    times; calls made while it restarts wait for it (``max_task_retries=-1``)."""
    options: dict[str, object] = {
        "num_cpus": num_cpus,
        "max_restarts": max_restarts,
        "max_task_retries": -1,
        "resources": resources or {},
    }
    if name is not None:
        options["name"] = name
    return ray.remote(ParameterServerActor).options(**options).remote(keep)


class RayObjectStoreParameterServer:
    """Client of a :class:`ParameterServerActor`: the ``ParameterServer`` protocol.

    Picklable (the actor handle travels; the retained reference does not), so the same
    object configures the trainer and every worker actor.

    Args:
        actor: handle from :func:`parameter_server_actor`.
        to_device: ``jax.device_put`` pulled arrays (a pull otherwise returns read-only
            ``numpy`` views of the object store).
        poll_interval_s: how often a waiting pull asks the actor again.
        default_timeout_s: the timeout of a pull that gives none (``None``: wait
            forever, as the protocol says).
        on_event: optional ``on_event(kind, version, duration_s=..., bytes=..., ...)``,
            and ``on_event("restart", None)`` when a push finds the actor restarted empty.
        retain_pushes: how many of its newest pushes the trainer's client keeps
            references to, for :meth:`republish` (a delta-published version needs the
            versions its chunks were last written in; see ``delta_store``).
        split_records: put each entry of a pushed ``dict`` as an object of its own, so
            that :meth:`read` fetches an entry when it is first used (a delta reader
            takes only the parts of a record it needs; Ray moves objects whole).
    """

    def __init__(
        self,
        actor: ParameterServerHandle,
        *,
        to_device: bool = True,
        poll_interval_s: float = 0.01,
        default_timeout_s: float | None = None,
        on_event: EventHook | None = None,
        retain_pushes: int = 1,
        split_records: bool = False,
    ) -> None:
        check_int("retain_pushes", retain_pushes, minimum=1)
        if poll_interval_s <= 0:
            raise ValueError(f"poll_interval_s: must be > 0, got {poll_interval_s}")
        self.actor = actor
        self.to_device = to_device
        self.poll_interval_s = poll_interval_s
        self.default_timeout_s = default_timeout_s
        self.on_event = on_event
        self.stats = TransferStats()
        self.retain_pushes = retain_pushes
        self.split_records = split_records
        # (version, ref, nbytes) of the newest pushes, kept for republish(); older freed.
        self._retained: collections.deque[tuple[int, ray.ObjectRef, int]] = collections.deque(
            maxlen=retain_pushes
        )
        self._pinned: tuple[int, ray.ObjectRef, int] | None = None  # The newest pinned push.

    def __getstate__(self) -> dict[str, object]:
        return {
            "actor": self.actor,
            "to_device": self.to_device,
            "poll_interval_s": self.poll_interval_s,
            "default_timeout_s": self.default_timeout_s,
            "retain_pushes": self.retain_pushes,
            "split_records": self.split_records,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        RayObjectStoreParameterServer.__init__(self, state.pop("actor"), **state)

    # -- the trainer's side ------------------------------------------------------------
    def push(self, version: int, params: object, *, reset: bool = False, pin: bool = False) -> None:
        """Copies ``params`` to host memory, puts them in the object store once, and
        registers the reference as ``version`` (``reset``: forget older versions first;
        ``pin``: the actor keeps it beyond ``keep`` until the next pinned push, and
        :meth:`republish` registers it again).

        Raises:
            ValueError: ``version`` is not newer than the latest registered version.
        """
        start = time.perf_counter()
        host = jax.device_get(params)
        nbytes = tree_nbytes(host)
        if self.split_records and isinstance(host, dict):
            # The outer object holds the entries' references, which keep them alive.
            host = {key: ray.put(value) for key, value in host.items()}
        ref = ray.put(host)
        after = None if reset or not self._retained else self._retained[-1][0]
        if not ray.get(self.actor.register.remote(int(version), [ref], nbytes, reset, pin, after)):
            # The actor restarted empty since this client's last push, and nobody has
            # registered anything since: what this client retains goes back first (a
            # LoRA run's pinned base record, the versions a delta's chunks live in).
            self.republish()
            ray.get(self.actor.register.remote(int(version), [ref], nbytes, False, pin))
            if self.on_event is not None:
                self.on_event("restart", None)
        if reset:
            self._retained.clear()
            self._pinned = None
        if pin:
            self._pinned = (int(version), ref, nbytes)
        self._retained.append((int(version), ref, nbytes))
        record = TransferRecord(
            kind="push", version=int(version), duration_s=time.perf_counter() - start, bytes=nbytes
        )
        record_transfer(self.stats, self.on_event, record)

    def republish(self) -> int | None:
        """Registers the retained pushes (the newest ``retain_pushes``, and the pinned
        one) the actor lacks again, oldest first (after it restarted empty); returns the
        newest version, or ``None`` if this client has not pushed."""
        if not self._retained:
            return None
        latest = self.latest_version()
        pushes = {version: (ref, nbytes) for version, ref, nbytes in self._retained}
        pinned = None
        if self._pinned is not None:
            pinned, ref, nbytes = self._pinned
            pushes[pinned] = (ref, nbytes)
        for version in sorted(pushes):
            if latest is None or latest < version:
                ref, nbytes = pushes[version]
                ray.get(
                    self.actor.register.remote(version, [ref], nbytes, False, version == pinned)
                )
                latest = version
        return self._retained[-1][0]

    # -- the workers' side -------------------------------------------------------------
    def latest_version(self) -> int | None:
        """The newest registered version, or ``None``."""
        return ray.get(self.actor.latest_version.remote())

    def versions(self) -> list[int]:
        """Versions the actor retains, oldest first."""
        return ray.get(self.actor.versions.remote())

    def read(self, version: int) -> object | None:
        """The host arrays of ``version`` (read-only views of the object store on this
        host), or ``None`` if the actor no longer retains it. Records no transfer: a
        caller that reads versions one by one (the delta client, ``delta_store``)
        accounts for what it uses.

        Raises:
            WeightsLostError: the version's owner died.
        """
        found = ray.get(self.actor.ref.remote(int(version)))
        if found is None:
            return None
        value = _get_weights(found[0], int(version))
        if isinstance(value, dict) and any(isinstance(v, ray.ObjectRef) for v in value.values()):
            return _SplitRecord(value, int(version))  # pushed with split_records
        return value

    def pull(self, min_version: int | None = None, timeout: float | None = None) -> tuple[int, Any]:
        """``(version, params)`` of the newest version, waiting for one ``>= min_version``.

        Raises:
            TimeoutError: no such version was registered within ``timeout`` seconds.
            WeightsLostError: the newest version's owner died (retry after the trainer
                publishes again).
        """
        timeout = self.default_timeout_s if timeout is None else timeout
        start = time.perf_counter()
        while True:
            found = ray.get(self.actor.latest.remote(min_version))
            if found is not None:
                break
            if timeout is not None and time.perf_counter() - start >= timeout:
                raise pull_timeout_error(
                    min_version, timeout, self.latest_version(), "the Ray object store"
                )
            time.sleep(self.poll_interval_s)
        ready_at = time.perf_counter()
        version, (ref,), nbytes = found
        params = _get_weights(ref, version)
        if self.to_device:
            params = jax.device_put(params)
            jax.block_until_ready(params)
        record = TransferRecord(
            kind="pull",
            version=version,
            duration_s=time.perf_counter() - ready_at,
            bytes=nbytes,
            wait_s=ready_at - start,
        )
        record_transfer(self.stats, self.on_event, record)
        return version, params


def _get_weights(ref: ray.ObjectRef, version: int) -> object:
    """``ray.get(ref)``; a lost object (its owner, the trainer, died) is a
    :class:`WeightsLostError`."""
    try:
        return ray.get(ref)
    except ObjectLostError as error:
        raise WeightsLostError(
            f"weights version {version} are lost ({type(error).__name__}): the trainer "
            "that put them died; keep the current weights until it publishes again"
        ) from error


class _SplitRecord(Mapping[Any, Any]):
    """A record pushed with ``split_records``: each entry is fetched (``ray.get``) when it
    is first used, then kept."""

    def __init__(self, refs: dict[object, object], version: int) -> None:
        self._refs, self._version = refs, version
        self._got: dict[object, object] = {}

    def __getitem__(self, key: object) -> object:
        if key not in self._got:
            value = self._refs[key]
            if isinstance(value, ray.ObjectRef):
                value = _get_weights(value, self._version)
            self._got[key] = value
        return self._got[key]

    def __contains__(self, key: object) -> bool:
        return key in self._refs  # Without fetching it.

    def __iter__(self) -> Iterator[object]:
        return iter(self._refs)

    def __len__(self) -> int:
        return len(self._refs)
