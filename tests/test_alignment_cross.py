"""Keras and torch versions of the same model give the same findings and notes."""

from __future__ import annotations

import pytest

pytest.importorskip("keras")
pytest.importorskip("torch")

from alignment_models.expected import CASES, finding_keys, note_keys
from alignment_models.reports import keras_report, torch_report


@pytest.mark.parametrize("name", sorted(CASES))
def test_keras_and_torch_agree(name):
    k, t = keras_report(name), torch_report(name)
    assert finding_keys(k) == finding_keys(t), f"keras:\n{k}\ntorch:\n{t}"
    assert note_keys(k) == note_keys(t)
    # The suggestion is the same number too (parameter costs differ: Keras and torch biases differ).
    assert {(f.dimension, f.value, f.suggested) for f in k.findings} == {
        (f.dimension, f.value, f.suggested) for f in t.findings}


def test_zoo_covers_every_rule():
    dims = {key[1] for case in CASES.values() for key in case.findings | case.notes}
    assert dims >= {"features_in", "features_out", "features", "channels_in", "channels_out", "head_dim",
                    "vocab", "rnn_hidden", "rnn_input", "tokens", "first_conv", "depthwise", "dtype"}
    assert len(CASES) >= 12
