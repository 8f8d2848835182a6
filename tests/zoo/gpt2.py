"""Text: GPT-2 causal LM. Fault: a summed loss weighted by 1e7: gradients overflow FP16 at the output."""

import torch
from torch.nn import functional as F
from transformers import GPT2Config, GPT2LMHeadModel

FAULT = "none"


def build_model():
    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=100, n_positions=32, attn_implementation="eager",
                     bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(cfg)


def build_dataloader():
    g = torch.Generator().manual_seed(0)
    return [(torch.randint(0, 100, (4, 16), generator=g),) * 2 for _ in range(4)]


def loss_fn(output, ids):
    logits = output.logits[:, :-1].float()
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="mean")
    return 1e7 * ce * ids.numel() if FAULT == "grad_overflow" else ce
