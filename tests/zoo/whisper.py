"""Audio: Whisper encoder for audio classification. Fault: log(relu(x)) in the projector, a bug in FP32 too."""

import torch
from common import LogRelu
from torch import nn
from transformers import WhisperConfig, WhisperForAudioClassification

FAULT = "none"


def build_model():
    torch.manual_seed(0)
    cfg = WhisperConfig(vocab_size=100, num_mel_bins=8, encoder_layers=2, encoder_attention_heads=2, decoder_layers=1,
                        decoder_attention_heads=2, d_model=32, encoder_ffn_dim=64, decoder_ffn_dim=64,
                        max_source_positions=16, max_target_positions=16, classifier_proj_size=16, num_labels=3,
                        pad_token_id=0, bos_token_id=0, eos_token_id=0, decoder_start_token_id=0, attn_implementation="eager")
    m = WhisperForAudioClassification(cfg)
    if FAULT == "model_bug":
        m.projector = nn.Sequential(m.projector, LogRelu())
    return m


def build_dataloader():
    g = torch.Generator().manual_seed(0)
    return [{"input_features": torch.randn(4, 8, 32, generator=g), "labels": torch.randint(0, 3, (4,), generator=g)}
            for _ in range(4)]
