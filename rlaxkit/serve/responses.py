"""The body of one choice of a chat-completions response, from a sampled turn.

``build_choice`` decodes the turn, cuts it at a request's ``stop`` string (``stop_at``),
reads Qwen-style tool calls back (``rlaxkit.serve.chat.parse_assistant``) into OpenAI's
``tool_calls`` (arguments as a JSON string), and adds the sampled ``token_ids`` and, when
asked, each token's log-prob.
"""

from __future__ import annotations

import json
from typing import Any

from rlaxkit.inference import Completion
from rlaxkit.models.tokenizer import Tokenizer
from rlaxkit.serve.chat import parse_assistant
from rlaxkit.serve.protocol import ChatRequest

__all__ = ["build_choice", "stop_at"]


def build_choice(
    tokenizer: Tokenizer, chat: ChatRequest, completion: Completion, index: int, *, call_id: str
) -> tuple[dict[str, Any], dict[str, Any], list[int]]:
    """One choice of the response, the assistant message a session keeps (tool
    call arguments parsed) and the ids the choice stands for (cut at a ``stop``)."""
    ids = completion.tokens.tolist()
    finish = "length" if completion.finish_reason == "length" else "stop"
    if chat.stop and (cut := stop_at(tokenizer, ids, chat.stop)) is not None:
        ids, finish = ids[:cut], "stop"
    text = tokenizer.decode(ids)
    for stop in chat.stop:
        text = text.split(stop, 1)[0]
    calls: list[tuple[str, object]] = []
    if chat.tools and chat.tool_choice != "none":
        content, calls = parse_assistant(text)
    else:
        content = text.strip()
    kept_calls = [
        {
            "id": f"{call_id}_{k}",
            "type": "function",
            "function": {"name": name, "arguments": arguments},
        }
        for k, (name, arguments) in enumerate(calls)
    ]
    message: dict[str, Any] = {"role": "assistant", "content": content or None}
    if calls:
        message["tool_calls"] = [
            {
                "id": c["id"],
                "type": "function",
                "function": {"name": n, "arguments": json.dumps(a)},
            }
            for c, (n, a) in zip(kept_calls, calls, strict=True)
        ]
        finish = "tool_calls"
    elif not content:
        message["content"] = ""
    logprobs = None
    if chat.logprobs:
        pieces = [tokenizer.decode([t], skip_special_tokens=False) for t in ids]
        logprobs = {
            "content": [
                {
                    "token": piece,
                    "logprob": lp,
                    "bytes": list(piece.encode()),
                    "top_logprobs": [],
                }
                for piece, lp in zip(pieces, completion.logprobs.tolist(), strict=False)
            ]
        }
    choice = {
        "index": index,
        "message": message,
        "finish_reason": finish,
        "token_ids": ids,
        "logprobs": logprobs,
    }
    kept = {"role": "assistant", "content": content, "tool_calls": kept_calls}
    return choice, kept, ids


def stop_at(tokenizer: Tokenizer, ids: list[int], stops: tuple[str, ...]) -> int | None:
    """The fewest leading ids whose text holds a stop string (``None``: none does). The
    ids after it are dropped: what was sampled up to there is what a sampler stopping
    there would have drawn."""
    for k in range(1, len(ids) + 1):
        text = tokenizer.decode(ids[:k])
        if any(stop in text for stop in stops):
            return k
    return None
