"""The zoo in PyTorch: ``build(name) -> (model, sample)``; module names match the Keras zoo's layer names."""

from __future__ import annotations

import itertools

import torch
from torch import nn

from .expected import CASES, SEQ

CL = torch.channels_last


class MLP(nn.Module):
    def __init__(self, sizes):
        super().__init__()
        for i, (a, b) in enumerate(itertools.pairwise(sizes)):
            self.add_module(f"fc{i + 1}", nn.Linear(a, b))

    def forward(self, x):
        layers = list(self.children())
        for i, layer in enumerate(layers):
            x = layer(x)
            if i < len(layers) - 1:
                x = torch.relu(x)
        return x


class Convs(nn.Module):
    def __init__(self, **convs):
        super().__init__()
        for name, conv in convs.items():
            self.add_module(name, conv)

    def forward(self, x):
        for conv in self.children():
            x = torch.relu(conv(x))
        return x.mean((2, 3))


class Attention(nn.Module):
    def __init__(self, embed, heads):
        super().__init__()
        self.mha = nn.MultiheadAttention(embed, heads, batch_first=True)

    def forward(self, x):
        return self.mha(x, x, x, need_weights=False)[0]


class TiedHead(nn.Module):
    """Output logits through the embedding's own matrix (weight tying), as GPT-2 does."""

    def __init__(self, emb: nn.Embedding):
        super().__init__()
        self.emb = emb

    def forward(self, x):
        return x @ self.emb.weight.t()


class TiedLM(nn.Module):
    def __init__(self, vocab=50257, width=64):
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.head = TiedHead(self.emb)

    def forward(self, tokens):
        return self.head(self.emb(tokens))


class Recurrent(nn.Module):
    def __init__(self, kind, size_in, hidden, num_layers=1):
        super().__init__()
        self.kind = kind
        self.add_module(kind, getattr(nn, kind.upper())(size_in, hidden, num_layers=num_layers,
                                                        batch_first=True))
        self.fc = nn.Linear(hidden, 16)

    def forward(self, x):
        out, _ = getattr(self, self.kind)(x)
        return self.fc(out[:, -1])


class RawProjection(nn.Module):
    """A custom layer multiplying by its own weight with ``@`` (no nn.Linear)."""

    def __init__(self, size_in, size_out):
        super().__init__()
        self.w = nn.Parameter(torch.randn(size_in, size_out) * 0.02)

    def forward(self, x):
        return x @ self.w


class Custom(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = RawProjection(50, 64)
        self.out = nn.Linear(64, 16)

    def forward(self, x):
        return self.out(torch.relu(self.proj(x)))


def _image(batch):
    return torch.randn(batch, 3, 16, 16).to(memory_format=CL)


def build(name: str):
    """``(model, sample)`` for one zoo case; image models are channels_last like Keras' NHWC."""
    batch = CASES[name].batch
    if name in ("aligned_mlp", "batch_only"):
        return MLP([64, 128, 64]), torch.randn(batch, 64)
    if name == "dense_in":
        return MLP([50, 64, 16]), torch.randn(batch, 50)
    if name == "dense_out":
        return MLP([64, 100, 16]), torch.randn(batch, 64)
    if name in ("fp32_tf32_off", "fp32_tf32_on"):
        model = nn.Sequential()
        model.add_module("fc", nn.Linear(50, 30))
        return model, torch.randn(batch, 50)
    if name == "conv_channels":
        model = Convs(conv1=nn.Conv2d(3, 30, 3, padding=1), conv2=nn.Conv2d(30, 64, 3, padding=1))
    elif name == "rgb_first_conv":
        model = Convs(conv1=nn.Conv2d(3, 32, 3, padding=1), conv2=nn.Conv2d(32, 64, 3, padding=1))
    elif name == "depthwise":
        model = Convs(conv1=nn.Conv2d(3, 32, 3, padding=1), dw=nn.Conv2d(32, 32, 3, padding=1, groups=32),
                      pw=nn.Conv2d(32, 64, 1))
    elif name == "grouped":
        model = Convs(conv1=nn.Conv2d(3, 48, 3, padding=1), grouped=nn.Conv2d(48, 48, 3, padding=1, groups=4))
    elif name == "conv_transpose":
        model = Convs(conv1=nn.Conv2d(3, 32, 3, padding=1), up=nn.ConvTranspose2d(32, 20, 3, padding=1),
                      conv2=nn.Conv2d(20, 64, 3, padding=1))
    elif name == "attention_50":
        return Attention(200, 4), torch.randn(batch, SEQ, 200)
    elif name == "attention_64":
        return Attention(256, 4), torch.randn(batch, SEQ, 256)
    elif name == "tied_vocab":
        return TiedLM(), torch.zeros(batch, SEQ, dtype=torch.long)
    elif name == "lstm":
        return Recurrent("lstm", 20, 30), torch.randn(batch, SEQ, 20)
    elif name == "stacked_lstm":
        return Recurrent("lstm", 20, 30, num_layers=2), torch.randn(batch, SEQ, 20)
    elif name == "gru":
        return Recurrent("gru", 32, 36), torch.randn(batch, SEQ, 32)
    elif name == "custom_matmul":
        return Custom(), torch.randn(batch, 50)
    else:
        raise KeyError(name)
    return model.to(memory_format=CL), _image(batch)
