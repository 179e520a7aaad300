"""Tokenizers behind one protocol: Hugging Face ``tokenizer.json`` files and a character
tokenizer for synthetic tasks.

Both render chat messages with ``apply_chat_template``; the HF tokenizer uses the
checkpoint's own Jinja template (from ``tokenizer_config.json``), the character
tokenizer a plain ``role: content`` layout.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol, runtime_checkable

import jinja2
import jinja2.sandbox
from tokenizers import Tokenizer as _HFTokenizerImpl


@runtime_checkable
class Tokenizer(Protocol):
    """What rlaxkit needs of a tokenizer."""

    vocab_size: int
    eos_id: int
    pad_id: int

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no special tokens added)."""
        ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``."""
        ...

    def apply_chat_template(
        self, messages: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> str:
        """Renders chat ``messages`` (``role``/``content`` dicts) as one prompt string."""
        ...


class CharTokenizer:
    """One token per character of a fixed alphabet, plus ``<pad>``, ``<eos>``, ``<unk>``.

    >>> tok = CharTokenizer("0123456789+=")
    >>> tok.decode(tok.encode("12+7=19"))
    '12+7=19'
    """

    PAD, EOS, UNK = "<pad>", "<eos>", "<unk>"

    def __init__(self, alphabet: str):
        if len(set(alphabet)) != len(alphabet):
            raise ValueError("alphabet has repeated characters")
        self.alphabet = alphabet
        self.pad_id, self.eos_id, self.unk_id = 0, 1, 2
        self._special = (self.PAD, self.EOS, self.UNK)
        self._index = {ch: i + len(self._special) for i, ch in enumerate(alphabet)}
        self.vocab_size = len(alphabet) + len(self._special)
        # Id -> text when special tokens are skipped (they read as "").
        self._text = {i: "" for i in range(len(self._special))} | {
            i: ch for ch, i in self._index.items()
        }

    def encode(self, text: str) -> list[int]:
        """One id per character; a character outside the alphabet is ``<unk>``."""
        return [self._index.get(ch, self.unk_id) for ch in text]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """The text of ``ids``; special tokens are dropped unless
        ``skip_special_tokens`` is false, and ids past the vocabulary are dropped."""
        if skip_special_tokens:
            try:  # one lookup a token (a run decodes every completion)
                return "".join([self._text[i] for i in ids])
            except (KeyError, TypeError):
                pass  # an id that is no entry (past the vocabulary, or not whole): below
        out = []
        for i in ids:
            i = int(i)
            if i < len(self._special):
                if not skip_special_tokens:
                    out.append(self._special[i])
            elif i < self.vocab_size:
                out.append(self.alphabet[i - len(self._special)])
        return "".join(out)

    def apply_chat_template(
        self, messages: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> str:
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
        return text + ("assistant: " if add_generation_prompt else "")

    def to_json(self) -> dict:
        return {"type": "char", "alphabet": self.alphabet}


class HFTokenizer:
    """A Hugging Face fast tokenizer read from ``tokenizer.json`` (+ its config)."""

    def __init__(self, tokenizer: _HFTokenizerImpl, config: dict | None = None):
        self.impl = tokenizer
        self.config = dict(config or {})
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        eos = _token_text(self.config.get("eos_token"))
        pad = _token_text(self.config.get("pad_token"))
        self.eos_id = self._id_of(eos) if eos else self._guess_eos()
        self.pad_id = self._id_of(pad) if pad else self.eos_id
        self.chat_template = self.config.get("chat_template")

    @classmethod
    def from_dir(cls, path: str | Path) -> HFTokenizer:
        """Loads ``tokenizer.json`` and, when present, ``tokenizer_config.json``."""
        path = Path(path)
        file = path / "tokenizer.json"
        if not file.exists():
            raise FileNotFoundError(f"no tokenizer.json in {path}")
        config_file = path / "tokenizer_config.json"
        config = json.loads(config_file.read_text()) if config_file.exists() else {}
        template_file = path / "chat_template.jinja"
        if "chat_template" not in config and template_file.exists():
            config["chat_template"] = template_file.read_text()
        return cls(_HFTokenizerImpl.from_file(str(file)), config)

    def save(self, path: str | Path) -> None:
        """Writes ``tokenizer.json`` and ``tokenizer_config.json`` into ``path``."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self.impl.save(str(path / "tokenizer.json"))
        (path / "tokenizer_config.json").write_text(json.dumps(self.config, indent=2))

    def _id_of(self, token: str) -> int:
        i = self.impl.token_to_id(token)
        if i is None:
            raise ValueError(f"tokenizer_config.json names token {token!r}, not in the vocab")
        return i

    def _guess_eos(self) -> int:
        for name in ("<|endoftext|>", "<|im_end|>", "<|end_of_text|>", "</s>", "<eos>"):
            i = self.impl.token_to_id(name)
            if i is not None:
                return i
        raise ValueError("tokenizer has no eos token: set 'eos_token' in tokenizer_config.json")

    def encode(self, text: str) -> list[int]:
        return self.impl.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.impl.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, messages: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> str:
        if not self.chat_template:
            raise ValueError(
                "this tokenizer has no chat_template; use a plain prompt template instead"
            )
        return _render_chat(
            self.chat_template,
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=_token_text(self.config.get("bos_token")) or "",
            eos_token=_token_text(self.config.get("eos_token")) or "",
        )


def _token_text(token: str | dict | None) -> str | None:
    if isinstance(token, dict):
        return token.get("content")
    return token


def _render_chat(template: str, **context: object) -> str:
    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda value, indent=None: json.dumps(value, indent=indent)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(template).render(**context)


def load_tokenizer(path: str | Path) -> Tokenizer:
    """Loads the tokenizer a directory holds: ``tokenizer.json`` or ``char_tokenizer.json``."""
    path = Path(path)
    char_file = path / "char_tokenizer.json"
    if char_file.exists():
        spec = json.loads(char_file.read_text())
        return CharTokenizer(spec["alphabet"])
    return HFTokenizer.from_dir(path)


def save_tokenizer(tokenizer: Tokenizer, path: str | Path) -> None:
    """Saves a tokenizer so ``load_tokenizer`` reads it back."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if isinstance(tokenizer, CharTokenizer):
        (path / "char_tokenizer.json").write_text(json.dumps(tokenizer.to_json()))
    elif isinstance(tokenizer, HFTokenizer):
        tokenizer.save(path)
    else:
        raise TypeError(f"cannot save a tokenizer of type {type(tokenizer).__name__}")
