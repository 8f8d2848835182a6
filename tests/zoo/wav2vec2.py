"""Audio: wav2vec 2.0 sequence classification. Fault: a custom autograd.Function without
custom_fwd/custom_bwd in the projector: its backward raises a dtype error under autocast."""

import torch
from common import CustomLinear
from transformers import Wav2Vec2Config, Wav2Vec2ForSequenceClassification

FAULT = "none"


def build_model():
    torch.manual_seed(0)
    cfg = Wav2Vec2Config(vocab_size=10, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                         conv_dim=(16, 16), conv_stride=(5, 4), conv_kernel=(10, 8), num_conv_pos_embeddings=8,
                         num_conv_pos_embedding_groups=2, classifier_proj_size=16, num_labels=3, mask_time_prob=0.0,
                         feat_extract_norm="layer", do_stable_layer_norm=True)
    m = Wav2Vec2ForSequenceClassification(cfg)
    if FAULT == "custom_fn":
        m.projector = CustomLinear(m.projector)
    return m


def build_dataloader():
    g = torch.Generator().manual_seed(0)
    return [{"input_values": torch.randn(4, 800, generator=g), "labels": torch.randint(0, 3, (4,), generator=g)}
            for _ in range(4)]
