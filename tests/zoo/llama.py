"""Text: Llama causal LM. Fault: pure FP16 weights with AdamW's eps=1e-8 (rounds to 0 in FP16)."""

import torch
from transformers import LlamaConfig, LlamaForCausalLM

FAULT = "none"


def build_model():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=2, max_position_embeddings=32, attn_implementation="eager")
    return LlamaForCausalLM(cfg)


def build_dataloader():
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(4):
        ids = torch.randint(0, 100, (4, 16), generator=g)
        out.append({"input_ids": ids, "labels": ids})
    return out


def build_optimizer(params):
    return torch.optim.AdamW(params, lr=1e-3, eps=1e-8)
