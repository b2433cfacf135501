import warnings

import pytest

from lossscale_callbacks import InMemorySink, Sink
from lossscale_callbacks._sinks import GuardedSink, SinkFailureWarning, SinkGroup


class Exploding(InMemorySink):
    def write(self, step, metrics):
        raise OSError("disk full")


def test_in_memory_sink_is_a_sink_and_keeps_everything():
    sink = InMemorySink()
    assert isinstance(sink, Sink)
    sink.write(1, {"a": 1})
    sink.write(2, {"a": 2.5, "b": 3})
    sink.write_text("report", "# hi")
    sink.flush()
    sink.close()
    assert sink.series("a") == [(1, 1.0), (2, 2.5)] and sink.series("b") == [(2, 3.0)]
    assert sink.texts == [("report", "# hi")] and sink.flushes == 1 and sink.closed


def test_a_failing_sink_warns_once_and_the_others_keep_every_value():
    good, bad = InMemorySink(), Exploding()
    group = SinkGroup([bad, good])
    with pytest.warns(SinkFailureWarning, match="Exploding sink failed in write.*disk full") as caught:
        for step in range(5):
            group.write(step, {"x": step})
        group.write_text("t", "m")
        group.close()
    assert len(caught) == 1
    assert good.series("x") == [(s, float(s)) for s in range(5)] and good.closed
    assert group.sinks[0].disabled and not group.sinks[1].disabled


def test_guard_rejects_objects_that_are_not_sinks():
    with pytest.raises(ValueError, match="write_text"):
        GuardedSink(object())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        SinkGroup([GuardedSink(InMemorySink(), name="mem")]).write(0, {})


def test_a_disabled_sink_is_still_closed_to_release_its_files():
    bad = Exploding()
    guarded = GuardedSink(bad)
    with pytest.warns(SinkFailureWarning):
        guarded.write(0, {"x": 1})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        guarded.close()
    assert bad.closed
