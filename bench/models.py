"""The bench models: a deep MLP, a small GPT-style transformer, a wide model (issue 6), and
pytorch/examples' word_language_model ``TransformerModel`` with a small vocabulary (issue 14)."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn


def deep_mlp() -> tuple[nn.Module, Callable[[torch.Generator], tuple[torch.Tensor, torch.Tensor]]]:
    """128 blocks of Linear(64,64) -> LayerNorm -> GELU, batch 32."""
    layers: list[nn.Module] = []
    for _ in range(128):
        layers += [nn.Linear(64, 64), nn.LayerNorm(64), nn.GELU()]
    model = nn.Sequential(*layers, nn.Linear(64, 1))

    def batch(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(32, 64, generator=g), torch.randn(32, 1, generator=g)

    return model, batch


class _Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)
        self.heads = heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / (d // self.heads) ** 0.5
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        att = att.masked_fill(mask, float("-inf")).softmax(dim=-1)
        x = x + self.proj((att @ v).transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab: int = 256, d: int = 128, layers: int = 4, heads: int = 4, seq: int = 64) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(seq, d)
        self.blocks = nn.ModuleList([_Block(d, heads) for _ in range(layers)])
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln(x))


def gpt() -> tuple[nn.Module, Callable[[torch.Generator], tuple[torch.Tensor, torch.Tensor]]]:
    """4 layers, d=128, seq 64, batch 8."""
    model = GPT()

    def batch(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.randint(0, 256, (8, 65), generator=g)
        return ids[:, :-1], ids[:, 1:]

    return model, batch


def wide() -> tuple[nn.Module, Callable[[torch.Generator], tuple[torch.Tensor, torch.Tensor]]]:
    """Few big layers: 3 x Linear(1024, 1024), batch 256 — tensor size dominates."""
    model = nn.Sequential(nn.Linear(1024, 1024), nn.GELU(), nn.Linear(1024, 1024), nn.GELU(), nn.Linear(1024, 1024))

    def batch(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(256, 1024, generator=g), torch.randn(256, 1024, generator=g)

    return model, batch


class PositionalEncoding(nn.Module):
    """word_language_model's sinusoidal positions, then dropout (inputs are [seq, batch, d])."""

    def __init__(self, d_model: int, dropout: float = 0.1, max_len: int = 5000) -> None:
        super().__init__()
        self.dropout = nn.Dropout(p=dropout)
        pe = torch.zeros(max_len, d_model)
        position = torch.arange(0, max_len, dtype=torch.float).unsqueeze(1)
        div_term = torch.exp(torch.arange(0, d_model, 2).float() * (-math.log(10000.0) / d_model))
        pe[:, 0::2] = torch.sin(position * div_term)
        pe[:, 1::2] = torch.cos(position * div_term)
        self.register_buffer("pe", pe.unsqueeze(0).transpose(0, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(x + self.pe[: x.size(0), :])


class TransformerModel(nn.Module):
    """pytorch/examples word_language_model's ``TransformerModel``: an nn.TransformerEncoder LM with
    a causal mask, embeddings scaled by sqrt(d), a linear decoder and log_softmax."""

    def __init__(self, ntoken: int, ninp: int, nhead: int, nhid: int, nlayers: int, dropout: float = 0.5) -> None:
        super().__init__()
        self.pos_encoder = PositionalEncoding(ninp, dropout)
        layer = nn.TransformerEncoderLayer(ninp, nhead, nhid, dropout)
        self.encoder = nn.TransformerEncoder(layer, nlayers, enable_nested_tensor=False)
        self.input_emb = nn.Embedding(ntoken, ninp)
        self.ninp = ninp
        self.decoder = nn.Linear(ninp, ntoken)
        initrange = 0.1
        nn.init.uniform_(self.input_emb.weight, -initrange, initrange)
        nn.init.zeros_(self.decoder.bias)
        nn.init.uniform_(self.decoder.weight, -initrange, initrange)

    def forward(self, src: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(len(src), device=src.device)
        x = self.pos_encoder(self.input_emb(src) * math.sqrt(self.ninp))
        return nn.functional.log_softmax(self.decoder(self.encoder(x, mask=mask)), dim=-1)


def word_lm() -> tuple[nn.Module, Callable[[torch.Generator], tuple[torch.Tensor, torch.Tensor]]]:
    """word_language_model's defaults (emsize 200, nhid 200, 2 layers, 2 heads, dropout 0.2, bptt 35,
    batch 20) with a vocabulary of 1,000 tokens instead of Wikitext-2's 33,278."""
    model = TransformerModel(1000, 200, 2, 200, 2, 0.2)

    def batch(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.randint(0, 1000, (36, 20), generator=g)  # [seq + 1, batch], as batchify/get_batch give
        return ids[:-1], ids[1:]

    return model, batch


class _Res(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x + self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x))))))


def resnet() -> tuple[nn.Module, Callable[[torch.Generator], tuple[torch.Tensor, torch.Tensor]]]:
    """A ResNet-style net (a stem, 3 stages of 2 basic blocks, 32-64-128 channels, strided convs between),
    32x32 RGB images, batch 32, 10 outputs."""
    layers: list[nn.Module] = [nn.Conv2d(3, 32, 3, padding=1, bias=False), nn.BatchNorm2d(32), nn.ReLU()]
    for i, c in enumerate((32, 64, 128)):
        if i:
            layers += [nn.Conv2d(c // 2, c, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(c), nn.ReLU()]
        layers += [_Res(c), _Res(c)]
    model = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(128, 10))

    def batch(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(32, 3, 32, 32, generator=g), torch.randn(32, 10, generator=g)

    return model, batch


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if y.dtype == torch.long:
        return nn.functional.cross_entropy(out.float().flatten(0, 1), y.flatten())
    return nn.functional.mse_loss(out.float(), y)


MODELS = {"deep_mlp": deep_mlp, "gpt": gpt, "wide": wide, "word_lm": word_lm, "resnet": resnet}
