"""An OpenAI-compatible endpoint over rlaxkit's inference: agents written against the
``openai`` client train unchanged, on the exact ids they were sampled as.

``ChatEndpoint`` serves ``/v1/chat/completions`` and ``/v1/models`` on 127.0.0.1
(aiohttp); a session (``X-Session-Id`` or ``extra_body={"session_id": ...}``) keeps the
ids sampled turn by turn and appends only the new messages' ids; reporting its reward
makes it a ``Rollout``.
"""

from rlaxkit.serve.chat import ChatFormat, parse_assistant, qwen_chat
from rlaxkit.serve.config import EndpointConfig
from rlaxkit.serve.protocol import ApiError, ChatRequest, parse_chat_request
from rlaxkit.serve.server import SESSION_HEADER, ChatEndpoint
from rlaxkit.serve.sessions import Session, SessionBook

__all__ = [
    "SESSION_HEADER",
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
