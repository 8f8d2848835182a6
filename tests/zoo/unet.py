"""Diffusion: a diffusers UNet2DModel predicting noise. Fault: a NaN-guard hook on every parameter
gradient that hides the overflows of a summed loss from GradScaler."""

import torch
from common import mask_grad_hooks
from diffusers import UNet2DModel

FAULT = "none"


def build_model():
    torch.manual_seed(0)
    m = UNet2DModel(sample_size=8, in_channels=3, out_channels=3, layers_per_block=1, block_out_channels=(8, 16),
                    norm_num_groups=4, down_block_types=("DownBlock2D", "DownBlock2D"),
                    up_block_types=("UpBlock2D", "UpBlock2D"))
    if FAULT == "amp_misuse":
        mask_grad_hooks(m)
    return m


def build_dataloader():
    g = torch.Generator().manual_seed(0)
    return [{"sample": torch.randn(4, 3, 8, 8, generator=g), "timestep": torch.randint(0, 1000, (4,), generator=g),
             "labels": torch.randn(4, 3, 8, 8, generator=g)} for _ in range(4)]


def loss_fn(output, noise):
    err = (output.sample.float() - noise).pow(2)
    return err.sum() * 10 if FAULT == "amp_misuse" else err.mean()
