"""Text: BERT sequence classification. Fault: attention logits (q @ k^T) overflow FP16."""

import torch
from transformers import BertConfig, BertForSequenceClassification

FAULT = "none"


def build_model():
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                     max_position_embeddings=32, num_labels=2, attn_implementation="eager")
    m = BertForSequenceClassification(cfg)
    if FAULT == "attn_overflow":
        att = m.bert.encoder.layer[1].attention.self
        with torch.no_grad():
            att.query.weight.mul_(1000.0)
            att.key.weight.mul_(1000.0)
    return m


def build_dataloader():
    g = torch.Generator().manual_seed(0)
    return [{"input_ids": torch.randint(0, 100, (4, 16), generator=g), "attention_mask": torch.ones(4, 16, dtype=torch.long),
             "labels": torch.randint(0, 2, (4,), generator=g)} for _ in range(4)]
