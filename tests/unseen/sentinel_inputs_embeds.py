"""(c1) Tabular rows fed to a small transformer through ``inputs_embeds`` (a dict batch, as a Hugging Face model
takes it), where -999999 marks a missing reading. The model adds position embeddings and a LayerNorm first: under AMP
the inputs stay FP32 and a LayerNorm keeps FP32 input in FP32 (CPU and CUDA autocast alike), so the sentinel is
normalised to a finite value and the run trains on it silently; raw FP16 turns it into -inf and fails at that batch.
Batch 2 holds it in sample 5, token 3, feature 7.

    ampdoctor triage tests/unseen/sentinel_inputs_embeds.py   # data, batch 2 (step 2)
"""

import torch
from torch import nn


class Encoder(nn.Module):
    def __init__(self, d: int = 16, tokens: int = 8) -> None:
        super().__init__()
        self.pos = nn.Parameter(torch.zeros(1, tokens, d))
        self.ln = nn.LayerNorm(d)
        self.layer = nn.TransformerEncoderLayer(d, 2, 32, dropout=0.0, batch_first=True)
        self.head = nn.Linear(d, 2)

    def forward(self, inputs_embeds):
        h = self.layer(self.ln(inputs_embeds + self.pos))
        return self.head(h.mean(dim=1))


def build_model() -> nn.Module:
    torch.manual_seed(7)
    return Encoder()


def build_dataloader():
    g = torch.Generator().manual_seed(7)
    out = []
    for i in range(6):
        x = torch.randn(12, 8, 16, generator=g)
        if i == 2:
            x[5, 3, 7] = -999999.0
        out.append({"inputs_embeds": x, "labels": (x[:, :, 0].mean(dim=1) > 0).long()})
    return out


def loss_fn(output, target):
    return nn.functional.cross_entropy(output.float(), target)
