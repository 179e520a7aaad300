"""Text in, text out: the ``generate(prompts, n, seed)`` callable the tasks package uses for
curation (pass-rate filtering) and evaluation.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from rlaxkit.inference.config import MIN_LENGTH_BUCKET, SamplingConfig, bucket_length
from rlaxkit.inference.generate import generate
from rlaxkit.inference.results import GenerationResult, ModelLike, prompt_keys, split_model
from rlaxkit.models import Tokenizer

TextGenerate = Callable[[list[str], int, int], list[list[str]]]


def make_text_generate(
    model: ModelLike,
    tokenizer: Tokenizer,
    config: SamplingConfig,
    *,
    batch_prompts: int | None = None,
    on_batch: Callable[[int], object] | None = None,
) -> TextGenerate:
    """A function ``generate(prompts, n, seed) -> [prompt][sample] completion strings``.

    Prompts are encoded with ``tokenizer`` as they are (apply a chat template first if
    the model needs one). The tokenizer's end-of-sequence id is added to
    ``config.stop_tokens``; ``n`` replaces ``config.n``. A completion that ended on a stop
    token is decoded without it; stop sequences are kept in the text.

    ``batch_prompts`` splits a call into ``generate`` calls of that many prompts, and
    ``on_batch(prompts_done)`` hears of each as it ends (a progress bar). The completions
    are those of one call: prompt ``i`` samples with the key one call gives it,
    ``fold_in(key(seed), i)``, every batch is padded to the same prompts and prompt width
    (one compiled program; the last batch repeats its last prompt), and a row's tokens do
    not depend on the batch it decodes in (``rlaxkit.inference.generate``).

    For example (a literal block: it needs a model and its tokenizer)::

        text_generate = make_text_generate(model, tokenizer, config)
        text_generate(["2+2="], 4, 0)  # [['4', '4', '5', '4']]
    """
    if batch_prompts is not None and batch_prompts < 1:
        raise ValueError(f"batch_prompts must be at least 1, got {batch_prompts}")
    weights = split_model(model)
    stop_tokens = tuple(dict.fromkeys((*config.stop_tokens, tokenizer.eos_id)))
    base = dataclasses.replace(config, stop_tokens=stop_tokens)

    def decode(result: GenerationResult) -> list[list[str]]:
        texts: list[list[str]] = []
        for row in result.completions():
            texts.append([])
            for completion in row:
                tokens = completion.tokens.tolist()
                if completion.finish_reason == "stop" and tokens and tokens[-1] in stop_tokens:
                    tokens = tokens[:-1]
                texts[-1].append(tokenizer.decode(tokens))
        return texts

    def text_generate(prompts: list[str], n: int = 1, seed: int = 0) -> list[list[str]]:
        if not prompts:
            return []
        sampling = dataclasses.replace(base, n=n)
        encoded = [tokenizer.encode(p) for p in prompts]
        size = min(batch_prompts or len(encoded), len(encoded))
        if size == len(encoded):
            texts = decode(generate(weights, encoded, sampling, seed))
            if on_batch is not None:
                on_batch(len(texts))
            return texts
        keys = list(prompt_keys(seed, len(encoded)))  # prompt i: fold_in(key(seed), i)
        width = bucket_length(max(len(e) for e in encoded), minimum=MIN_LENGTH_BUCKET)
        texts = []
        for start in range(0, len(encoded), size):
            batch, batch_keys = encoded[start : start + size], keys[start : start + size]
            real = len(batch)
            batch += [batch[-1]] * (size - real)
            batch_keys += [batch_keys[-1]] * (size - real)
            result = generate(weights, batch, sampling, batch_keys, min_prompt_width=width)
            texts += decode(result)[:real]
            if on_batch is not None:
                on_batch(real)
        return texts

    return text_generate
