"""Vision: ViT image classification. Fault: NaN pixels in batch 2."""

import torch
from transformers import ViTConfig, ViTForImageClassification

FAULT = "none"


def build_model():
    torch.manual_seed(0)
    cfg = ViTConfig(image_size=16, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                    intermediate_size=64, num_labels=3, attn_implementation="eager")
    return ViTForImageClassification(cfg)


def build_dataloader():
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(4):
        px = torch.randn(4, 3, 16, 16, generator=g)
        if FAULT == "data_nan" and i == 2:
            px[1, 0, 3, 3] = float("nan")
        out.append({"pixel_values": px, "labels": torch.randint(0, 3, (4,), generator=g)})
    return out
