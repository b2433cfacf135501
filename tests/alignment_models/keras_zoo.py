"""The zoo in Keras 3: ``build(name) -> model``; layer names match the torch zoo's module names.

Build inside the dtype policy the case asks for (the tests' fixture sets and restores it).
"""

from __future__ import annotations

import keras
from keras import layers, ops

from .expected import CASES, SEQ


@keras.saving.register_keras_serializable(package="lsc_zoo")
class TiedHead(layers.Layer):
    """Output logits through the embedding's own matrix (weight tying)."""

    def __init__(self, emb, **kwargs):
        super().__init__(**kwargs)
        self.emb = emb

    def call(self, x):
        return ops.matmul(x, ops.transpose(self.emb.embeddings))


@keras.saving.register_keras_serializable(package="lsc_zoo")
class RawProjection(layers.Layer):
    """A custom layer multiplying by its own weight with ``ops.matmul`` (no Dense)."""

    def __init__(self, units, **kwargs):
        super().__init__(**kwargs)
        self.units = units

    def build(self, input_shape):
        self.w = self.add_weight(shape=(input_shape[-1], self.units), initializer="glorot_uniform", name="w")

    def call(self, x):
        return ops.matmul(x, self.w)

    def get_config(self):
        return {**super().get_config(), "units": self.units}


def _mlp(sizes):
    inp = keras.Input((sizes[0],))
    x = inp
    for i, units in enumerate(sizes[1:]):
        last = i == len(sizes) - 2
        x = layers.Dense(units, activation=None if last else "relu", name=f"fc{i + 1}")(x)
    return keras.Model(inp, x)


def _convs(*convs):
    inp = keras.Input((16, 16, 3))
    x = inp
    for conv in convs:
        x = conv(x)
    return keras.Model(inp, layers.GlobalAveragePooling2D(name="pool")(x))


def _conv(filters, name, kernel=3, groups=1):
    return layers.Conv2D(filters, kernel, padding="same", groups=groups, activation="relu", name=name)


def _attention(embed, heads):
    inp = keras.Input((SEQ, embed))
    return keras.Model(inp, layers.MultiHeadAttention(heads, embed // heads, name="mha")(inp, inp))


def _recurrent(kind, size_in, hidden, num_layers=1):
    inp = keras.Input((SEQ, size_in))
    if num_layers > 1:  # one RNN over stacked cells, like torch's num_layers
        x = layers.RNN(layers.StackedRNNCells([layers.LSTMCell(hidden) for _ in range(num_layers)]),
                       name=kind)(inp)
    else:
        cls = layers.LSTM if kind == "lstm" else layers.GRU
        x = cls(hidden, name=kind)(inp)
    return keras.Model(inp, layers.Dense(16, name="fc")(x))


def build(name: str):
    """A Keras model for one zoo case (the batch size comes from ``CASES[name].batch``)."""
    assert name in CASES
    if name in ("aligned_mlp", "batch_only"):
        return _mlp([64, 128, 64])
    if name == "dense_in":
        return _mlp([50, 64, 16])
    if name == "dense_out":
        return _mlp([64, 100, 16])
    if name in ("fp32_tf32_off", "fp32_tf32_on"):
        return keras.Sequential([keras.Input((50,)), layers.Dense(30, name="fc")])
    if name == "conv_channels":
        return _convs(_conv(30, "conv1"), _conv(64, "conv2"))
    if name == "rgb_first_conv":
        return _convs(_conv(32, "conv1"), _conv(64, "conv2"))
    if name == "depthwise":
        return _convs(_conv(32, "conv1"), layers.DepthwiseConv2D(3, padding="same", name="dw"),
                      _conv(64, "pw", kernel=1))
    if name == "grouped":
        return _convs(_conv(48, "conv1"), _conv(48, "grouped", groups=4))
    if name == "conv_transpose":
        up = layers.Conv2DTranspose(20, 3, padding="same", activation="relu", name="up")
        return _convs(_conv(32, "conv1"), up, _conv(64, "conv2"))
    if name == "attention_50":
        return _attention(200, 4)
    if name == "attention_64":
        return _attention(256, 4)
    if name == "tied_vocab":
        inp = keras.Input((SEQ,), dtype="int32")
        emb = layers.Embedding(50257, 64, name="emb")
        return keras.Model(inp, TiedHead(emb, name="head")(emb(inp)))
    if name == "lstm":
        return _recurrent("lstm", 20, 30)
    if name == "stacked_lstm":
        return _recurrent("lstm", 20, 30, num_layers=2)
    if name == "gru":
        return _recurrent("gru", 32, 36)
    if name == "custom_matmul":
        inp = keras.Input((50,))
        x = RawProjection(64, name="proj")(inp)
        return keras.Model(inp, layers.Dense(16, name="out")(layers.ReLU()(x)))
    raise KeyError(name)
