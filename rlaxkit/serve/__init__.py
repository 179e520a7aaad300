"""An OpenAI-compatible endpoint over rlaxkit's inference: agents written against the
``openai`` client train unchanged, on the exact ids they were sampled as.

``ChatEndpoint`` serves ``/v1/chat/completions`` and ``/v1/models`` on 127.0.0.1
(aiohttp, the ``serve`` extra); a session (``X-Session-Id`` or ``extra_body=
{"session_id": ...}``) keeps the ids sampled turn by turn and appends only the new
messages' ids; reporting its reward makes it a ``Rollout``. ``RunConfig.agent``
(``AgentConfig``) trains a user's agent through it (``rlaxkit.serve.agents``).

The server's names load on first use, so that a run config (which imports
``AgentConfig``) needs no aiohttp.
"""

from rlaxkit.serve.chat import ChatFormat, parse_assistant, qwen_chat
from rlaxkit.serve.config import AgentConfig, EndpointConfig
from rlaxkit.serve.protocol import ApiError, ChatRequest, parse_chat_request
from rlaxkit.serve.sessions import Session, SessionBook

__all__ = [
    "SESSION_HEADER",
    "AgentConfig",
    "ApiError",
    "ChatEndpoint",
    "ChatFormat",
    "ChatRequest",
    "EndpointConfig",
    "Session",
    "SessionBook",
    "parse_assistant",
    "parse_chat_request",
    "qwen_chat",
]


def __getattr__(name: str) -> object:
    if name in ("ChatEndpoint", "SESSION_HEADER"):
        try:
            from rlaxkit.serve import server
        except ImportError as error:  # pragma: no cover - the extra is missing
            raise ImportError(
                f"rlaxkit.serve.{name} needs aiohttp: pip install -e '.[serve]'"
            ) from error
        return getattr(server, name)
    raise AttributeError(f"module 'rlaxkit.serve' has no attribute {name!r}")
