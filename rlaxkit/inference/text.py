"""Text in, text out: the ``generate(prompts, n, seed)`` callable the tasks package uses for
curation (pass-rate filtering) and evaluation.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from rlaxkit.inference.config import SamplingConfig
from rlaxkit.inference.generate import generate
from rlaxkit.inference.results import ModelLike, split_model
from rlaxkit.models import Tokenizer

TextGenerate = Callable[[list[str], int, int], list[list[str]]]


def make_text_generate(
    model: ModelLike, tokenizer: Tokenizer, config: SamplingConfig
) -> TextGenerate:
    """A function ``generate(prompts, n, seed) -> [prompt][sample] completion strings``.

    Prompts are encoded with ``tokenizer`` as they are (apply a chat template first if
    the model needs one). The tokenizer's end-of-sequence id is added to
    ``config.stop_tokens``; ``n`` replaces ``config.n``. A completion that ended on a stop
    token is decoded without it; stop sequences are kept in the text.

    For example (a literal block: it needs a model and its tokenizer)::

        text_generate = make_text_generate(model, tokenizer, config)
        text_generate(["2+2="], 4, 0)  # [['4', '4', '5', '4']]
    """
    weights = split_model(model)
    stop_tokens = tuple(dict.fromkeys((*config.stop_tokens, tokenizer.eos_id)))
    base = dataclasses.replace(config, stop_tokens=stop_tokens)

    def text_generate(prompts: list[str], n: int = 1, seed: int = 0) -> list[list[str]]:
        if not prompts:
            return []
        sampling = dataclasses.replace(base, n=n)
        encoded = [tokenizer.encode(p) for p in prompts]
        result = generate(weights, encoded, sampling, seed)
        texts: list[list[str]] = []
        for row in result.completions():
            texts.append([])
            for completion in row:
                tokens = completion.tokens.tolist()
                if completion.finish_reason == "stop" and tokens and tokens[-1] in stop_tokens:
                    tokens = tokens[:-1]
                texts[-1].append(tokenizer.decode(tokens))
        return texts

    return text_generate
