"""Chat messages as the model reads them: rendering with tools, and tool calls parsed back.

``ChatFormat`` renders OpenAI-style messages (and the request's ``tools``) to the text
the model's chat template gives, and reads a sampled turn back into the assistant
message the client sees: Qwen-style ``<tool_call>{"name": ..., "arguments": ...}
</tool_call>`` blocks become ``tool_calls``, the rest is the content.

A tokenizer whose own template names ``tools`` renders with it (Jinja, as its model was
trained); one without (or a template given as ``None``) gets ``qwen_chat``: Qwen's
layout of ChatML turns, a system turn listing the tools' schemas in ``<tools>``,
assistant tool calls in ``<tool_call>`` blocks and tool results in a user turn's
``<tool_response>`` blocks.

>>> text = qwen_chat([{"role": "user", "content": "2+2?"}], add_generation_prompt=True)
>>> text
'<|im_start|>user\\n2+2?<|im_end|>\\n<|im_start|>assistant\\n'
>>> parse_assistant('<tool_call>\\n{"name": "calc", "arguments": {"x": "2+2"}}\\n</tool_call>')
('', [('calc', {'x': '2+2'})])
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

import jinja2
import jinja2.sandbox

from rlaxkit.models.tokenizer import HFTokenizer, Tokenizer

__all__ = ["ChatFormat", "parse_assistant", "qwen_chat"]

Message = Mapping[str, Any]  # an OpenAI chat message, checked by ``protocol``

_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_SENTINEL = "\x00rlaxkit-turn\x00"  # no template writes it: marks where content ends


def _call_text(name: str, arguments: object) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def qwen_chat(
    messages: Sequence[Message],
    tools: Sequence[Mapping[str, object]] = (),
    *,
    add_generation_prompt: bool,
) -> str:
    """Qwen's ChatML layout with tools (the fallback when a template has none).

    ``messages`` carry ``role``, ``content`` (a string) and, for an assistant,
    ``tool_calls`` in the OpenAI shape with ``arguments`` already parsed to JSON values.
    A system turn lists each tool's schema as a JSON line inside ``<tools>`` and shows
    the call format; consecutive tool messages share one user turn of
    ``<tool_response>`` blocks.
    """
    parts: list[str] = []
    rest = list(messages)
    if tools:
        system = rest.pop(0)["content"] + "\n\n" if rest and rest[0]["role"] == "system" else ""
        listing = "\n".join(json.dumps(t) for t in tools)
        parts.append(
            f"<|im_start|>system\n{system}# Tools\n\nFunctions you may call, one JSON "
            f"schema a line:\n<tools>\n{listing}\n</tools>\n\nTo call one, write "
            f"{_call_text('<name>', '<arguments>')}<|im_end|>\n"
        )
    for i, message in enumerate(rest):
        role, content = message["role"], message.get("content") or ""
        if role == "tool":
            first = i == 0 or rest[i - 1]["role"] != "tool"
            last = i == len(rest) - 1 or rest[i + 1]["role"] != "tool"
            parts.append(
                ("<|im_start|>user" if first else "")
                + f"\n<tool_response>\n{content}\n</tool_response>"
                + ("<|im_end|>\n" if last else "")
            )
            continue
        calls = message.get("tool_calls") or ()
        text = content + "".join(
            ("\n" if content or k else "")
            + _call_text(c["function"]["name"], c["function"]["arguments"])
            for k, c in enumerate(calls)
        )
        parts.append(f"<|im_start|>{role}\n{text}<|im_end|>\n")
    if add_generation_prompt:
        parts.append("<|im_start|>assistant\n")
    return "".join(parts)


def parse_assistant(text: str) -> tuple[str, list[tuple[str, object]]]:
    """A sampled turn's content (the text outside tool-call blocks, stripped) and its
    tool calls as ``(name, arguments)``. A block that is not a JSON object with a string
    ``name`` stays in the content, as the model wrote it."""
    calls: list[tuple[str, object]] = []
    kept: list[str] = []
    position = 0
    for match in _TOOL_CALL.finditer(text):
        try:
            call = json.loads(match.group(1))
        except ValueError:
            continue
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            continue
        kept.append(text[position : match.start()])
        position = match.end()
        calls.append((call["name"], call.get("arguments", {})))
    kept.append(text[position:])
    return "".join(kept).strip(), calls


def _jinja(template: str) -> jinja2.Template:
    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda value, indent=None: json.dumps(value, indent=indent)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(template)


class ChatFormat:
    """Renders chat messages for one tokenizer, and reads sampled turns back.

    Args:
        tokenizer: the model's tokenizer; an ``HFTokenizer`` whose template names
            ``tools`` renders with that template, any other with ``qwen_chat`` (whose
            ChatML markers the tokenizer should hold as tokens).
        template: a Jinja template to render with instead (``messages``, ``tools``,
            ``add_generation_prompt``).
        end_of_turn: the text that ends an assistant turn; its id, when it is one
            token, stops sampling (with the tokenizer's end token).
    """

    def __init__(
        self, tokenizer: Tokenizer, *, template: str | None = None, end_of_turn: str = "<|im_end|>"
    ):
        self.tokenizer = tokenizer
        if template is None and isinstance(tokenizer, HFTokenizer):
            template = (
                tokenizer.chat_template if "tools" in (tokenizer.chat_template or "") else None
            )
        self._template = _jinja(template) if template else None
        self._special: dict[str, str] = {}
        if isinstance(tokenizer, HFTokenizer):
            for key in ("bos_token", "eos_token"):
                value = tokenizer.config.get(key)
                self._special[key] = (
                    value.get("content") if isinstance(value, dict) else value
                ) or ""
        ids = tokenizer.encode(end_of_turn)
        turn_end = tuple(ids) if len(ids) == 1 else ()
        self.stop_tokens = tuple(dict.fromkeys((tokenizer.eos_id, *turn_end)))
        # What the template writes after an assistant turn's content ("<|im_end|>\n").
        closed = self.render(
            [{"role": "user", "content": "x"}, {"role": "assistant", "content": _SENTINEL}],
            add_generation_prompt=False,
        )
        self.turn_closing = closed.split(_SENTINEL, 1)[1]

    def render(
        self,
        messages: Sequence[Message],
        tools: Sequence[Mapping[str, object]] = (),
        *,
        add_generation_prompt: bool,
    ) -> str:
        """The text of ``messages`` (and ``tools``) as the model's template writes it."""
        if self._template is None:
            return qwen_chat(messages, tools, add_generation_prompt=add_generation_prompt)
        return self._template.render(
            messages=list(messages),
            tools=list(tools) or None,
            add_generation_prompt=add_generation_prompt,
            **self._special,
        )

    def closing(self, sampled: Sequence[int]) -> str:
        """The rest of the turn's closing after a sampled turn: ``turn_closing`` less the
        end token the model sampled itself (``"\\n"`` after ``<|im_end|>``)."""
        if sampled and int(sampled[-1]) in self.stop_tokens:
            written = self.tokenizer.decode([int(sampled[-1])], skip_special_tokens=False)
            if self.turn_closing.startswith(written):
                return self.turn_closing[len(written) :]
        return self.turn_closing
