"""The endpoint's settings."""

from __future__ import annotations

from dataclasses import dataclass

from rlaxkit.validation import check_int, check_number

__all__ = ["EndpointConfig"]


@dataclass(frozen=True, kw_only=True)
class EndpointConfig:
    """How the OpenAI-compatible endpoint serves (``rlaxkit.serve.ChatEndpoint``).

    Attributes:
        host: the address it listens on; ``127.0.0.1`` (this machine only) by default.
        port: its port; 0 picks a free one (``ChatEndpoint.url`` says which).
        model_name: the one model name it serves (``GET /v1/models``).
        temperature: the sampling temperature of every request (a behaviour policy the
            trainer can correct for); a request naming another one is refused.
        max_new_tokens: the most tokens one assistant turn may sample (``max_tokens``).
        max_prompt_tokens: the longest conversation, in ids, a turn may follow.
        slots: engine rows: turns decoded at once, across all sessions.
        max_queued: turns that may wait for a row before requests get 429.
        session_timeout_s: a session with no request for this long (and no reward
            reported) is dropped as ``"timeout"``.
        chunk_steps: decode steps between the points where rows refill and weights change.
        seed: seeds the turns' sampling keys (turn ``k`` served: ``seed + k``).
    """

    host: str = "127.0.0.1"
    port: int = 0
    model_name: str = "rlaxkit"
    temperature: float = 1.0
    max_new_tokens: int = 64
    max_prompt_tokens: int = 512
    slots: int = 16
    max_queued: int = 256
    session_timeout_s: float = 300.0
    chunk_steps: int = 8
    seed: int = 0

    def __post_init__(self) -> None:
        check_int("port", self.port, minimum=0, maximum=65535)
        check_int("max_new_tokens", self.max_new_tokens, minimum=1)
        check_int("max_prompt_tokens", self.max_prompt_tokens, minimum=1)
        check_int("slots", self.slots, minimum=1)
        check_int("max_queued", self.max_queued, minimum=1)
        check_int("chunk_steps", self.chunk_steps, minimum=1)
        check_int("seed", self.seed, minimum=0)
        check_number("temperature", self.temperature, minimum=0.0)
        check_number("session_timeout_s", self.session_timeout_s, minimum=0.0)
        if not isinstance(self.host, str) or not self.host:
            raise ValueError(f"host: must be an address such as '127.0.0.1', got {self.host!r}")
        if not isinstance(self.model_name, str) or not self.model_name:
            raise ValueError(f"model_name: must be a non-empty string, got {self.model_name!r}")
