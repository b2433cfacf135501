"""The ledger's core room: entries as JSON lines, host-side sample tracking, the bounded book, skip lists."""

from __future__ import annotations

import json

import pytest

from lossscale_callbacks import skip_samples
from lossscale_callbacks.ledger._book import Ledger
from lossscale_callbacks.ledger._entry import Entry, MicroBatch, Replay, verdict_of
from lossscale_callbacks.ledger._read import read_ledger_file, read_ledgers
from lossscale_callbacks.ledger._samples import SampleTracker
from lossscale_callbacks.ledger._skip import skip_list

REPLAY = Replay(scale=1024.0, same=False, low_scale=1.0, low=False, float32=True, micro_finite=(True, False),
                rows=((), (1,)), producer="fc2", origin="head")


def test_an_entry_round_trips_through_its_json_line_with_non_finite_scales():
    entry = Entry(7, 1, "overflow", float("inf"), (MicroBatch(0, (1, 2)), MicroBatch(1, (3, 4), 0, 6)),
                  replay=REPLAY)
    line = entry.to_json()
    assert "\n" not in line and json.loads(line)["scale"] == "inf"
    assert Entry.from_json(line) == entry
    assert entry.culprits() == (4,)  # the second micro-batch reproduced, its row 1
    with pytest.raises(ValueError, match="not a ledger entry"):
        Entry.from_json('{"rank": 0}')


@pytest.mark.parametrize(("same", "low", "float32", "others", "verdict"), [
    (True, None, None, (), "transient"), (True, None, None, (1,), "other_rank"),
    (False, True, None, (), "scale"), (False, False, True, (), "float16_range"),
    (False, False, False, (), "data"), (False, False, None, (), None)])
def test_each_replay_has_one_verdict(same, low, float32, others, verdict):
    assert verdict_of(Replay(8.0, same, 1.0, low, float32, other_ranks=others)) == verdict


def test_micro_batches_are_filed_under_their_step_and_the_tracker_is_bounded():
    tracker = SampleTracker(max_micro_batches=4)
    for step in range(1, 4):
        for micro in range(2):  # gradient accumulation: two micro-batches a step
            tracker.produced([step * 10 + micro], epoch=0, batch=2 * (step - 1) + micro)
            tracker.consumed()
        tracker.step_ended()
    assert tracker.of_step(1) == ()  # forgotten for the bound
    assert tracker.forgotten == 2
    assert [(m.index, m.samples, m.batch) for m in tracker.of_step(3)] == [(0, (30,), 4), (1, (31,), 5)]
    tracker.release_through(3)
    assert tracker.of_step(3) == ()


def test_the_book_caps_its_entries_and_says_so(tmp_path):
    book = Ledger(tmp_path, rank=3, max_entries=2)
    for step in range(1, 5):
        book.add(Entry(step, 3, "overflow", 8.0))
    book.close()
    assert [e.step for e in read_ledger_file(tmp_path / "bad_steps.rank3.jsonl")] == [1, 2]
    assert book.dropped == 2
    assert any("at most 2 entries a run: 2 more" in s for s in book.sentences())


def test_ranks_merge_and_a_step_written_twice_counts_once(tmp_path):
    for rank in (0, 1):
        book = Ledger(tmp_path, rank=rank)
        book.add(Entry(5, rank, "overflow", 8.0, replay=REPLAY))
        book.add(Entry(5, rank, "overflow", 4.0))  # appended again by a resumed run: the last line wins
        book.close()
    merged = read_ledgers(tmp_path)
    assert [(e.step, e.rank, e.scale) for e in merged] == [(5, 0, 4.0), (5, 1, 4.0)]


def test_the_skip_list_blames_only_steps_that_overflowed_again_at_any_scale():
    transient = Entry(1, 0, "overflow", 8.0, (MicroBatch(0, (5, 6), 0, 0),), replay=Replay(8.0, True))
    scale = Entry(2, 0, "overflow", 8.0, (MicroBatch(0, (7,), 0, 1),), replay=Replay(8.0, False, 1.0, True))
    bad = Entry(3, 0, "overflow", 8.0, (MicroBatch(0, (8, 9), 0, 2), MicroBatch(1, (10, 11), 0, 3)),
                replay=REPLAY)
    unreplayed = Entry(4, 0, "overflow", 8.0, (MicroBatch(0, (12,), 1, 0),))
    entries = [transient, scale, bad, unreplayed]
    assert skip_list(entries) == {"samples": [11], "batches": [3], "steps": [3]}
    assert skip_list(entries, include="all")["samples"] == [11, 12]
    with pytest.raises(ValueError, match="include must be one of"):
        skip_list(entries, include="some")


def test_skip_samples_leaves_them_out_and_knows_its_length_where_it_can():
    class Sampler:
        data_source = range(6)

        def __iter__(self):
            return iter([4, 1, 5, 0, 2, 3])

        def __len__(self):
            return 6

        def set_epoch(self, epoch):
            self.epoch = epoch

    wrapped = skip_samples(Sampler(), [1, 4, 99])
    assert list(wrapped) == [5, 0, 2, 3] and len(wrapped) == 4
    wrapped.set_epoch(2)  # the wrapped sampler's
    with pytest.raises(ValueError, match="sampler must be an iterable"):
        skip_samples(3, [1])


def test_the_loop_tells_the_ledger_a_read_carried_in_its_summary_and_closes_its_file(tmp_path):
    """The ledger plugs into the logging loop as a room: the book comes with a read (``carry``), its lines
    join the summary on every integration alike, and the run's end closes its file."""
    from lossscale_callbacks import DynamicPolicy, InMemorySink, LoggingLoop, LossScaleState
    from lossscale_callbacks.skips._outcomes import IntervalOutcomes, StepOutcome, carry

    book = Ledger(tmp_path, rank=0)
    book.add(Entry(3, 0, "overflow", 1024.0, (MicroBatch(0, (5, 9)),)))
    loop = LoggingLoop(DynamicPolicy(initial_scale=1024.0), log_every=4, sinks=[InMemorySink()], echo=None)
    outcomes = IntervalOutcomes(1, 4, (StepOutcome(3, "overflow", 1024.0),), {"overflow": 1})
    loop.observe(carry(LossScaleState(512.0, 1, 1, 1, 4), outcomes=outcomes, ledger=book))
    assert book._file is not None
    summary = loop.finish(LossScaleState(512.0, 2, 1, 1, 5))  # a last read that carries no ledger
    lines = summary.splitlines()
    assert "Step 3 was bad (overflow); not replayed (off)." in lines
    assert f"Ledger: {book.path} (`lossscale-callbacks report` lists the bad samples)." in lines
    assert book._file is None
    loop.start()
    assert "Ledger" not in loop.finish(LossScaleState(512.0, 2, 1, 1, 6))  # a new run: no book carried yet
