"""The endpoint's settings."""

from __future__ import annotations

from dataclasses import dataclass

from rlaxkit.rules.validation import check_int, check_number

__all__ = ["AgentConfig", "EndpointConfig"]


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
        chat_template: a Jinja chat template (``messages``, ``tools``,
            ``add_generation_prompt``) to render with instead of the tokenizer's;
            ``None``: the tokenizer's when it names tools, else Qwen's layout.
        stop: strings the engine stops at for every request (a request's ``stop`` among
            them costs nothing; another is cut after sampling).
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
    chat_template: str | None = None
    stop: tuple[str, ...] = ()

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
        object.__setattr__(self, "stop", tuple(self.stop))
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop: must be non-empty strings, got {self.stop!r}")


@dataclass(frozen=True, kw_only=True)
class AgentConfig:
    """A run whose samples come from a user's agent through the endpoint
    (``RunConfig.agent``; ``rlaxkit.serve.agents``).

    The agent is a function in a Python file, ``function(client, model, prompt)``:
    ``client`` an ``openai.OpenAI`` pointed at the endpoint (its session set in a
    header; it shares its agent copy's connections, so the agent must not close it),
    ``model`` the served name, ``prompt`` the problem's text. It returns its
    final answer (scored with the task's reward) or a reward (a number).

    Attributes:
        file: the Python file (a path from the working directory).
        function: the function's name in it.
        copies: agents running at once (each one conversation at a time).
        host, port: where the endpoint listens (port 0: a free one).
        model_name: the model name it serves.
        chat_template, stop: as ``EndpointConfig``'s.
        slots: engine rows.
        session_timeout_s: a conversation silent this long is dropped as ``"timeout"``.
    """

    file: str
    function: str = "run"
    copies: int = 8
    host: str = "127.0.0.1"
    port: int = 0
    model_name: str = "rlaxkit"
    chat_template: str | None = None
    stop: tuple[str, ...] = ()
    slots: int = 64
    session_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if not isinstance(self.file, str) or not self.file.endswith(".py"):
            raise ValueError(f"file: must be the path of a Python file, got {self.file!r}")
        if not isinstance(self.function, str) or not self.function.isidentifier():
            raise ValueError(f"function: must be a function name, got {self.function!r}")
        check_int("copies", self.copies, minimum=1)
        check_int("slots", self.slots, minimum=1)
        # The rest as the endpoint checks them.
        EndpointConfig(
            host=self.host,
            port=self.port,
            model_name=self.model_name,
            stop=self.stop,
            session_timeout_s=self.session_timeout_s,
        )
