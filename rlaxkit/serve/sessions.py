"""Token-exact sessions: the ids an agent's conversation was sampled as, turn by turn.

A session starts with the rendered prompt's ids. Each turn the endpoint samples is kept
as the ids it sampled, with their behaviour log-probs and weight versions; the next
request of the session must repeat the conversation so far (the assistant message as
the endpoint returned it) and may add messages after it, whose ids alone are appended:
the template's text for them, encoded on its own (``SessionBook.extend``). No earlier
turn is ever re-encoded, so the trained row is the sampled ids and the appended ids,
id for id. Appended ids carry no loss (``policy_mask`` False, log-prob 0, version
``ENVIRONMENT_VERSION``), as an episode's observations do.

``report`` turns a session into a ``Rollout`` with the agent's reward; a session that
reports nothing within ``timeout_s`` of its last request is dropped, its reason counted.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rlaxkit.data.rollout import ENVIRONMENT_VERSION, Rollout
from rlaxkit.serve.protocol import ApiError

__all__ = ["Session", "SessionBook"]


@dataclass
class Session:
    """One conversation's token record (see the module docstring).

    Attributes:
        id: the session id the client sends.
        group_id, sample_index, problem_id: where its rollout goes (GRPO's group).
        prompt_ids: the first request's rendered prompt.
        tokens, policy_mask, logprobs, versions: every id after the prompt.
        messages: the conversation so far, as the endpoint checks the next request
            against (the assistant turns as it returned them).
        tools: the first request's tools (a session keeps them).
        turns: assistant turns sampled.
        busy: a request of this session is being answered.
        last_s: ``time.monotonic()`` of its last request.
    """

    id: str
    group_id: int
    sample_index: int
    problem_id: str
    prompt_ids: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    policy_mask: list[bool] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    messages: list[dict[str, object]] = field(default_factory=list)
    tools: tuple[dict[str, object], ...] = ()
    turns: int = 0
    busy: bool = False
    last_s: float = field(default_factory=time.monotonic)
    last_finish: str = "stop"

    @property
    def context(self) -> list[int]:
        """Every id so far: the next turn's prompt."""
        return self.prompt_ids + self.tokens

    def add_sampled(
        self, ids: Sequence[int], logprobs: Sequence[float], versions: Sequence[int]
    ) -> None:
        """Appends a sampled turn: in the loss, with its behaviour log-probs and versions."""
        self.tokens.extend(int(t) for t in ids)
        self.policy_mask.extend([True] * len(ids))
        self.logprobs.extend(float(x) for x in logprobs)
        self.versions.extend(int(v) for v in versions)

    def add_appended(self, ids: Sequence[int]) -> None:
        """Appends ids the agent's messages brought: out of the loss."""
        self.tokens.extend(int(t) for t in ids)
        self.policy_mask.extend([False] * len(ids))
        self.logprobs.extend([0.0] * len(ids))
        self.versions.extend([ENVIRONMENT_VERSION] * len(ids))

    def to_rollout(self, reward: float, info: Mapping[str, object] | None = None) -> Rollout:
        """The session as one ``Rollout`` (prompt: the first rendering; completion:
        every id after it, the appended ones out of the loss)."""
        return Rollout(
            group_id=self.group_id,
            sample_index=self.sample_index,
            problem_id=self.problem_id,
            prompt_tokens=np.asarray(self.prompt_ids, np.int32),
            completion_tokens=np.asarray(self.tokens, np.int32),
            behaviour_logprobs=np.asarray(self.logprobs, np.float32),
            versions=np.asarray(self.versions, np.int32),
            reward=float(reward),
            finish_reason=self.last_finish,
            worker_id="endpoint",
            reward_info={"turns": self.turns, "session": self.id, **(info or {})},
            policy_mask=np.asarray(self.policy_mask, bool),
        )


def same_message(sent: dict[str, Any], kept: dict[str, Any]) -> bool:
    """Whether a message the client sent back is one the session holds (role, content,
    and the tool calls' names and arguments; call ids and extra fields aside)."""

    def calls(m: dict[str, Any]) -> list[tuple[str, object]]:
        return [
            (c["function"]["name"], c["function"]["arguments"]) for c in m.get("tool_calls", ())
        ]

    return (
        sent["role"] == kept["role"]
        and sent["content"].strip() == kept["content"].strip()
        and calls(sent) == calls(kept)
    )


class SessionBook:
    """Open sessions, and the count of those dropped, by reason (thread-safe).

    Args:
        timeout_s: a session with no request for this long is dropped as ``"timeout"``.
        on_rollout: receives each reported session's ``Rollout`` (e.g. into a buffer).
        on_drop: receives ``(session, reason)`` for each dropped session.
    """

    def __init__(
        self,
        timeout_s: float,
        on_rollout: Callable[[Rollout], object] | None = None,
        on_drop: Callable[[Session, str], object] | None = None,
    ):
        self.timeout_s = timeout_s
        self.on_rollout, self.on_drop = on_rollout, on_drop
        self.sessions: dict[str, Session] = {}
        self.dropped: Counter[str] = Counter()
        self.reported = 0
        self._ended: dict[str, str] = {}  # id -> "reported" or the drop reason
        self._groups = itertools.count()
        self._lock = threading.Lock()

    def open(
        self,
        session_id: str | None = None,
        *,
        group_id: int | None = None,
        sample_index: int = 0,
        problem_id: str = "",
    ) -> Session:
        """A new session (by default its own group of one)."""
        with self._lock:
            group = next(self._groups) if group_id is None else group_id
            sid = session_id or f"session-{group}-{sample_index}"
            if sid in self.sessions or sid in self._ended:
                raise ApiError(
                    f"session_id: {sid!r} is already in use", param="session_id", status=409
                )
            session = Session(sid, group, sample_index, problem_id or sid)
            self.sessions[sid] = session
            return session

    def claim(self, session_id: str) -> Session:
        """The session, marked busy for one request."""
        with self._lock:
            session = self._get(session_id)
            if session.busy:
                raise ApiError(
                    f"session_id: session {session_id!r} is answering another request; a "
                    "session's turns go one after the other",
                    param="session_id",
                    status=409,
                )
            session.busy, session.last_s = True, time.monotonic()
            return session

    def free(self, session: Session) -> None:
        with self._lock:
            session.busy, session.last_s = False, time.monotonic()

    def _get(self, session_id: str) -> Session:
        session = self.sessions.get(session_id)
        if session is None:
            ended = self._ended.get(session_id)
            why = f"it ended ({ended})" if ended else "open it first (POST /v1/sessions)"
            raise ApiError(
                f"session_id: unknown session {session_id!r}: {why}",
                param="session_id",
                status=404,
                code="session_not_found",
            )
        return session

    def report(
        self, session_id: str, reward: float, info: Mapping[str, object] | None = None
    ) -> Rollout:
        """Ends the session with ``reward``; its rollout goes to ``on_rollout``."""
        with self._lock:
            session = self._get(session_id)
            if session.busy or not session.turns:
                what = (
                    "a request is still being answered" if session.busy else "no turn was sampled"
                )
                raise ApiError(
                    f"session_id: session {session_id!r} cannot report yet: {what}",
                    param="session_id",
                    status=409,
                )
            del self.sessions[session_id]
            self._ended[session_id] = "reported"
            self.reported += 1
        rollout = session.to_rollout(reward, info)
        if self.on_rollout is not None:
            self.on_rollout(rollout)
        return rollout

    def drop(self, session_id: str, reason: str) -> None:
        """Ends a session without a rollout, counting ``reason``."""
        with self._lock:
            session = self.sessions.pop(session_id, None)
            if session is None:
                return
            self._ended[session_id] = f"dropped: {reason}"
            self.dropped[reason] += 1
        if self.on_drop is not None:
            self.on_drop(session, reason)

    def sweep(self, now_s: float | None = None) -> list[str]:
        """Drops the idle sessions that reached their timeout; returns their ids."""
        now_s = time.monotonic() if now_s is None else now_s
        with self._lock:
            stale = [
                s.id
                for s in self.sessions.values()
                if not s.busy and now_s - s.last_s >= self.timeout_s
            ]
        for sid in stale:
            self.drop(sid, "timeout")
        return stale
