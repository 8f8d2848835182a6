"""Vision: ConvNeXt, multi-label. Fault: a hand-written BCE whose log(1 - sigmoid) is -inf in FP16."""

import torch
from common import hand_bce
from transformers import ConvNextConfig, ConvNextForImageClassification

FAULT = "none"


def build_model():
    torch.manual_seed(0)
    cfg = ConvNextConfig(num_channels=3, num_stages=2, patch_size=2, hidden_sizes=[8, 16], depths=[1, 1], num_labels=4, image_size=16)
    m = ConvNextForImageClassification(cfg)
    if FAULT == "loss_bce":
        with torch.no_grad():
            m.classifier.bias.fill_(12.0)  # confident logits near 12: sigmoid is 1.0 in FP16 (above ~8.3), not in FP32
    return m


def build_dataloader():
    g = torch.Generator().manual_seed(0)
    return [{"pixel_values": torch.randn(4, 3, 16, 16, generator=g),
             "labels": (torch.rand(4, 4, generator=g) > 0.5).float()} for _ in range(4)]


def loss_fn(output, target):
    if FAULT == "loss_bce":
        return hand_bce(output.logits, target)
    return torch.nn.functional.binary_cross_entropy_with_logits(output.logits.float(), target)
