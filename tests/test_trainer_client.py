"""The driver's trainer client: healing a trainer that died, with the batches it keeps
for that bounded by ``runtime.trainer_replay_mb``."""

import logging
import threading

import jax
import numpy as np
import pytest

from rlaxkit.api import PublishReply, SaveReply, TrainResult
from rlaxkit.config.run import RuntimeConfig
from rlaxkit.rules.books import RunBooks
from rlaxkit.runtime.common import RunTrace
from rlaxkit.runtime.trainer_client import HealingTrainerClient

MB = 1_000_000


class Died(Exception):
    """The fake trainer process died."""


class FakeTrainer:
    """A trainer group of one: its state is the list of steps it trained; ``kill``
    makes the next call fail, and the restart restores the newest saved step."""

    size = 1

    def __init__(self):
        self.trained: list[int] = []
        self.saved: list[int] = []
        self.dead = False

    def call(self, method, *args):
        if self.dead:
            raise Died(method)
        return getattr(self, method)(*args)

    def train(self, batch, step, push):
        assert self.trained == list(range(1, step)), "trained out of order"
        self.trained.append(step)
        return TrainResult({"loss": float(step)}, 0.01)

    def save_checkpoint(self, step, json, weights, wait):
        self.saved.append(step)
        return SaveReply(True)

    def restore(self, max_step, published=None):
        step = max([s for s in self.saved if s <= max_step], default=0)
        self.trained = list(range(1, step + 1))
        return step

    def publish(self, step, reset=False):
        return PublishReply(step)

    def restart(self):
        self.dead = False

    def preempt(self):
        self.dead = True

    def stop(self, timeout_s=0.0):
        pass


def batch(mb: float) -> jax.ShapeDtypeStruct:
    """A batch of ``mb`` megabytes, abstract (the client only counts its bytes)."""
    return jax.ShapeDtypeStruct((int(mb * MB),), np.uint8)


def client(limit_mb):
    books = RunBooks()
    trace = RunTrace(None, 0, threading.RLock(), {})
    trainer = FakeTrainer()
    kept = HealingTrainerClient(
        trainer, trace, books, lambda: 0.0, 2, died=(Died,), replay_limit_mb=limit_mb
    )
    return kept, trainer, books


def train(kept, books, steps, mb=1.0):
    for step in steps:
        books.record_step(kept.train(batch(mb), step, True).duration_s)


def test_a_dead_trainer_is_healed_from_its_checkpoint_and_the_kept_batches():
    kept, trainer, books = client(limit_mb=10.0)
    train(kept, books, range(1, 4))
    kept.save(3, {}, None)
    train(kept, books, range(4, 7))
    assert [s for s, _ in kept.replay] == [4, 5, 6]  # the checkpoint covers 1..3
    trainer.preempt()
    train(kept, books, [7])  # dies, restores step 3, replays 4..6, then trains 7
    assert trainer.trained == list(range(1, 8))
    assert books.preemptions["trainer"] == 1


def test_the_kept_batches_stay_within_the_bound_and_the_newest_is_always_kept():
    kept, trainer, books = client(limit_mb=3.5)
    train(kept, books, range(1, 11))
    assert [s for s, _ in kept.replay] == [8, 9, 10]  # 3 MB of 1 MB batches
    assert kept.let_go_through == 7
    big, _, big_books = client(limit_mb=0.5)
    train(big, big_books, range(1, 4), mb=2.0)  # each batch alone passes the bound
    assert [s for s, _ in big.replay] == [3]
    unbounded, _, unbounded_books = client(limit_mb=None)
    train(unbounded, unbounded_books, range(1, 11))
    assert len(unbounded.replay) == 10 and unbounded.let_go_through == 0


def test_a_death_that_needs_a_batch_let_go_names_the_checkpoint_setting(caplog):
    kept, trainer, books = client(limit_mb=3.5)
    with caplog.at_level(logging.WARNING, logger="rlaxkit.runtime.trainer_client"):
        train(kept, books, range(1, 11))
    (warning,) = [r for r in caplog.records if "trainer_replay_mb" in r.getMessage()]
    assert "checkpoint.every_steps" in warning.getMessage()
    trainer.preempt()
    with pytest.raises(RuntimeError, match=r"restored step 0.*steps 1\.\.8 were let go") as error:
        train(kept, books, [11])
    assert "runtime.trainer_replay_mb=3.5 held 3 steps" in str(error.value)
    assert "checkpoint.every_steps <= 3" in str(error.value)


def test_a_checkpoint_after_the_bound_makes_a_death_healable_again():
    kept, trainer, books = client(limit_mb=3.5)
    train(kept, books, range(1, 11))
    kept.save(10, {}, None)
    assert kept.replay == [] and kept.let_go_through == 0
    train(kept, books, range(11, 13))
    trainer.preempt()
    train(kept, books, [13])
    assert trainer.trained == list(range(1, 14))


def test_a_collated_batch_counts_its_arrays():
    from rlaxkit.data.batch import Sample, collate

    one = collate(
        [
            Sample(
                prompt_tokens=[1, 2],
                completion_tokens=[3],
                behaviour_logprobs=[-0.5],
                versions=0,
                reward=1.0,
                group_id="g",
            )
        ]
    )
    nbytes = sum(getattr(one, f).nbytes for f in ("tokens", "attention_mask", "loss_mask"))
    nbytes += sum(
        getattr(one, f).nbytes
        for f in ("behaviour_logprobs", "versions", "rewards", "group_ids", "sequence_mask")
    )
    # Room for two such batches, not three: the oldest of three is let go.
    kept, _, books = client(limit_mb=2.5 * nbytes / MB)
    for step in (1, 2, 3):
        books.record_step(kept.train(one, step, True).duration_s)
    assert [s for s, _ in kept.replay] == [2, 3] and kept.let_go_through == 1


def test_the_bound_is_a_named_setting():
    assert RuntimeConfig().trainer_replay_mb == 4096.0
    assert RuntimeConfig(trainer_replay_mb=None).trainer_replay_mb is None
    with pytest.raises(ValueError, match=r"trainer_replay_mb: must be a number >= 0"):
        RuntimeConfig(trainer_replay_mb=-1)


class StartedTrainer(FakeTrainer):
    """A fake Ray trainer group: ``start`` sends a call and returns its wait. With
    ``die_while`` set, the trainer dies while the call runs: the wait raises."""

    die_while = False

    def start(self, method, *args):
        if self.dead:
            raise Died(method)
        if self.die_while:
            self.die_while, self.dead = False, True

            def died():
                raise Died(method)

            return died
        reply = getattr(self, method)(*args)
        return lambda: reply


@pytest.mark.parametrize("death", ["before", "while"])
def test_a_trainer_that_dies_beside_the_rounds_is_healed_after_them(death):
    books = RunBooks()
    trace = RunTrace(None, 0, threading.RLock(), {})
    trainer = StartedTrainer()
    kept = HealingTrainerClient(trainer, trace, books, lambda: 0.0, 2, died=(Died,))
    rounds = []
    for step in (1, 2):
        books.record_step(kept.train(batch(1.0), step, False, rounds.append).duration_s)
    kept.save(2, {}, None)
    books.record_step(kept.train(batch(1.0), 3, False, rounds.append).duration_s)
    if death == "before":
        trainer.preempt()  # the step's call fails at once
    else:
        trainer.die_while = True  # the step's wait fails after the rounds
    books.record_step(kept.train(batch(1.0), 4, False, rounds.append).duration_s)
    # The rounds ran once a step; the trainer restored step 2, replayed 3 and took 4.
    assert len(rounds) == 4 and not any(stop.is_set() for stop in rounds)
    assert trainer.trained == [1, 2, 3, 4]
    assert books.preemptions["trainer"] == 1 and books.lost_steps == 1
