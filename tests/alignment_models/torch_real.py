"""Real-model shapes, built the way their papers and reference code build them (no pretrained weights).

ResNet-50 (torchvision's layout), GPT-2 small (vocabulary 50257, tied head), BERT-base (the encoder
with its embeddings, no task head) and ViT-B/16 (224x224, 197 tokens). Built on the ``meta`` device by
the tests: only shapes are traced, no memory is allocated for the 124M-parameter models.
"""

from __future__ import annotations

import torch
from torch import nn


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, inplanes: int, planes: int, stride: int = 1, downsample: nn.Module | None = None):
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, planes * 4, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(planes * 4)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        return self.relu(self.bn3(self.conv3(out)) + identity)


class ResNet50(nn.Module):
    def __init__(self, num_classes: int = 1000):
        super().__init__()
        self.inplanes = 64
        self.conv1 = nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        self.layer1 = self._layer(64, 3)
        self.layer2 = self._layer(128, 4, stride=2)
        self.layer3 = self._layer(256, 6, stride=2)
        self.layer4 = self._layer(512, 3, stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(2048, num_classes)

    def _layer(self, planes: int, blocks: int, stride: int = 1) -> nn.Sequential:
        downsample = None
        if stride != 1 or self.inplanes != planes * 4:
            downsample = nn.Sequential(nn.Conv2d(self.inplanes, planes * 4, 1, stride=stride, bias=False),
                                       nn.BatchNorm2d(planes * 4))
        layers = [Bottleneck(self.inplanes, planes, stride, downsample)]
        self.inplanes = planes * 4
        layers += [Bottleneck(self.inplanes, planes) for _ in range(1, blocks)]
        return nn.Sequential(*layers)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


class SelfAttention(nn.Module):
    def __init__(self, dim: int, heads: int, causal: bool):
        super().__init__()
        self.heads, self.causal = heads, causal
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, causal: bool, pre_norm: bool = True):
        super().__init__()
        self.pre_norm = pre_norm
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = SelfAttention(dim, heads, causal)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        if self.pre_norm:
            x = x + self.attn(self.ln1(x))
            return x + self.mlp(self.ln2(x))
        x = self.ln1(x + self.attn(x))
        return self.ln2(x + self.mlp(x))


class GPT2(nn.Module):
    """GPT-2 small: 12 layers, 12 heads, 768 wide, vocabulary 50257, context 1024, tied head."""

    def __init__(self, vocab: int = 50257, dim: int = 768, layers: int = 12, heads: int = 12):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, dim), nn.Embedding(1024, dim)
        self.h = nn.ModuleList(Block(dim, heads, causal=True) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


class BertEncoder(nn.Module):
    """BERT-base: vocabulary 30522, 12 layers, 12 heads, 768 wide, 512 positions, post-norm."""

    def __init__(self, vocab: int = 30522, dim: int = 768, layers: int = 12, heads: int = 12):
        super().__init__()
        self.word_embeddings = nn.Embedding(vocab, dim)
        self.position_embeddings = nn.Embedding(512, dim)
        self.token_type_embeddings = nn.Embedding(2, dim)
        self.norm = nn.LayerNorm(dim)
        self.layer = nn.ModuleList(Block(dim, heads, causal=False, pre_norm=False) for _ in range(layers))
        self.pooler = nn.Linear(dim, dim)

    def forward(self, input_ids):
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.norm(self.word_embeddings(input_ids) + self.position_embeddings(positions)
                      + self.token_type_embeddings(torch.zeros_like(input_ids)))
        for block in self.layer:
            x = block(x)
        return torch.tanh(self.pooler(x[:, 0]))


class ViT(nn.Module):
    """ViT-B/16: 224x224 images in 16x16 patches (196 + a class token = 197 tokens), 12 layers, 768 wide."""

    def __init__(self, num_classes: int = 1000, dim: int = 768, layers: int = 12, heads: int = 12):
        super().__init__()
        self.patch_embed = nn.Conv2d(3, dim, 16, stride=16)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.zeros(1, 197, dim))
        self.blocks = nn.Sequential(*(Block(dim, heads, causal=False) for _ in range(layers)))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_classes)

    def forward(self, x):
        x = self.patch_embed(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        return self.head(self.norm(self.blocks(x))[:, 0])


def build(name: str, batch: int):
    """``(model, sample)`` on the meta device."""
    with torch.device("meta"):
        if name == "resnet50":
            return ResNet50(), torch.empty(batch, 3, 224, 224)
        if name == "gpt2":
            return GPT2(), torch.empty(batch, 1024, dtype=torch.long)
        if name == "bert":
            return BertEncoder(), torch.empty(batch, 128, dtype=torch.long)
        if name == "vit":
            return ViT(), torch.empty(batch, 3, 224, 224)
    raise ValueError(f"name must be one of ['bert', 'gpt2', 'resnet50', 'vit'], got {name!r}")
