"""A calculator agent written against the OpenAI chat API, and nothing else.

``run(client, model, prompt)`` asks the model to solve ``prompt`` ("417*38="). When the
model writes ``<calc>417*38`` and stops at ``</calc>`` (the request's stop string), the
agent works the expression out itself and sends ``=15846`` and a newline back as the
next user message; the model's next turn is its answer, which ``run`` returns.
``configs/agent_calculator.yaml`` trains it with ``rlaxkit train``; any OpenAI-compatible
server runs it as it is.
"""

from __future__ import annotations

import ast
import operator

import openai

OPERATORS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}


def calculate(expression: str) -> str:
    """``=value`` for ``+ - * // %`` of integers, else ``=error: ...``."""

    def value(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
            return OPERATORS[type(node.op)](value(node.left), value(node.right))
        raise ValueError("only numbers and + - * / // % are allowed")

    try:
        result = value(ast.parse(expression.strip(), mode="eval").body)
    except SyntaxError:
        return "=error: not an expression\n"
    except ZeroDivisionError:
        return "=error: division by zero\n"
    except ValueError as error:
        return f"=error: {error}\n"
    if abs(result) > 10**18:
        return "=error: number too large\n"
    return f"={result}\n"


def run(client: openai.OpenAI, model: str, prompt: str, max_turns: int = 3) -> str:
    """Plays one problem; returns the model's final answer."""
    messages = [{"role": "user", "content": prompt}]
    answer = ""
    for turn in range(max_turns):
        try:
            reply = client.chat.completions.create(model=model, messages=messages, stop=["</calc>"])
        except openai.BadRequestError:  # the conversation outgrew the model's context
            return answer
        answer = reply.choices[0].message.content or ""
        messages.append({"role": "assistant", "content": answer})
        if "<calc>" not in answer or turn == max_turns - 1:
            return answer
        messages.append({"role": "user", "content": calculate(answer.rsplit("<calc>", 1)[1])})
    return answer
