"""Text: RoBERTa sequence classification. Fault: the loss normalised by a corpus size (1e15):
every gradient is far below FP16's smallest subnormal even after GradScaler's 65536."""

import torch
from transformers import RobertaConfig, RobertaForSequenceClassification

FAULT = "none"


def build_model():
    torch.manual_seed(0)
    cfg = RobertaConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                        max_position_embeddings=40, num_labels=2, attn_implementation="eager", pad_token_id=1)
    return RobertaForSequenceClassification(cfg)


def build_dataloader():
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(4):
        ids = torch.randint(3, 100, (8, 12), generator=g)
        out.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": (ids[:, 0] > 50).long()})
    return out


def loss_fn(output, labels):
    ce = torch.nn.functional.cross_entropy(output.logits.float(), labels)
    return ce / 1e15 if FAULT == "grad_underflow" else ce


def build_optimizer(params):
    return torch.optim.Adam(params, lr=1e-3, eps=1e-30)  # scale-invariant: FP32 trains on the tiny loss
