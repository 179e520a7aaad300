"""What the ``InferenceEngine`` keeps of each sample between chunks: the sample queued
or in a row, the tokens a preempted one keeps, an observation waiting for its prefill."""

from __future__ import annotations

import collections
import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

__all__ = ["KeptTokens", "PendingResume", "QueuedSample", "SampleBooks", "prompt_key"]


class QueuedSample(NamedTuple):
    """One sample of one request, queued or in a row (a tuple: a run builds one a
    sample, at a third of a frozen dataclass's cost).

    ``prompt`` is the context before the current turn: the prompt, then for a resumed
    request every earlier turn's completion and observation.
    """

    request_id: int
    sample_index: int
    prompt: np.ndarray
    key_data: np.ndarray
    budget: int
    hold: bool = False
    done: KeptTokens | None = None  # what the sample had when its row was preempted


class KeptTokens(NamedTuple):
    """The tokens a preempted sample had, with their log-probs and versions; its prompt
    ends with these tokens and its budget is what is left."""

    tokens: np.ndarray
    logprobs: np.ndarray
    plain_logprobs: np.ndarray
    versions: np.ndarray


@dataclass(frozen=True)
class PendingResume:
    """A parked row's observation, prefilled at the next launch."""

    key: tuple[int, int]  # (request, sample)
    row: int
    observation: np.ndarray


def prompt_key(sample: QueuedSample) -> tuple[int, int]:
    """Which prefill a sample's row starts from: its request's prompt, shared by the
    samples ``submit`` queued together (one array)."""
    return sample.request_id, id(sample.prompt)


@dataclass
class SampleBooks:
    """Where an engine's samples are between chunks: queued (``queue``), in a row
    (``slots``; ``admitted``, the admission that put it there), parked between turns
    (``parked``: (request, sample) -> row) or waiting to resume (``resumes``), and how
    many samples each request still has out (``unfinished``). ``ends`` is each row's
    write offset (``state.cache.end``) as the host knows it: set by a refill or a
    resume, read back after each chunk, which decodes on the shortest cache view that
    holds every generating row's writes. ``ids`` and ``admissions`` number requests and
    admissions."""

    queue: collections.deque[QueuedSample]
    slots: list[QueuedSample | None]
    parked: dict[tuple[int, int], int]
    resumes: list[PendingResume]
    unfinished: collections.Counter[int]  # request id -> samples
    admitted: np.ndarray
    ends: np.ndarray
    ids: Iterator[int]
    admissions: Iterator[int]

    @classmethod
    def empty(cls, num_slots: int) -> SampleBooks:
        """No sample anywhere, for an engine of ``num_slots`` rows."""
        return cls(
            queue=collections.deque(),
            slots=[None] * num_slots,
            parked={},
            resumes=[],
            unfinished=collections.Counter(),
            admitted=np.zeros((num_slots,), np.int64),
            ends=np.zeros((num_slots,), np.int64),
            ids=itertools.count(),
            admissions=itertools.count(),
        )
