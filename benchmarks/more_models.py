"""Two more models for benchmarks/sim_vs_real.py's `--model` (issue 30): an encoder-decoder and a windowed-attention
vision transformer, tiny, built in code (nothing downloaded).

    benchmarks/sim_vs_real.py --models mlp --model more_models:tiny_bart --model more_models:tiny_swin --batch 8
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

os.environ.setdefault("HF_HUB_OFFLINE", "1")


class Seq2SeqLoss(nn.Module):
    """input_ids, labels -> the Hugging Face seq2seq model's own loss."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, labels=labels, use_cache=False).loss


class ImageLoss(nn.Module):
    """images, labels -> cross-entropy of the classifier."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.model(images), labels)


def tiny_bart(batch: int = 8, seq_len: int = 32) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """BART (transformers BartConfig): 2 + 2 layers of width 128, 4 heads, feed-forward 256, vocabulary 1024, tied
    embeddings, the final_logits_bias buffer, no dropout."""
    from transformers import BartConfig, BartForConditionalGeneration

    cfg = BartConfig(vocab_size=1024, d_model=128, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                     decoder_attention_heads=4, encoder_ffn_dim=256, decoder_ffn_dim=256, max_position_embeddings=64,
                     dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, pad_token_id=1, bos_token_id=0,
                     eos_token_id=2, decoder_start_token_id=2, forced_eos_token_id=None)
    ids = torch.randint(3, 1024, (batch, seq_len))
    return Seq2SeqLoss(BartForConditionalGeneration(cfg)), (ids, torch.randint(3, 1024, (batch, seq_len)))


def tiny_swin(batch: int = 8) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """Swin (torchvision's SwinTransformer, swin_t's structure): patch 4, width 32, depths 2 + 2, 2 and 4 heads,
    window 4, on 32x32 images, 10 classes, no stochastic depth."""
    from torchvision.models.swin_transformer import SwinTransformer

    swin = SwinTransformer(patch_size=[4, 4], embed_dim=32, depths=[2, 2], num_heads=[2, 4], window_size=[4, 4],
                           stochastic_depth_prob=0.0, num_classes=10)
    return ImageLoss(swin), (torch.randn(batch, 3, 32, 32), torch.randint(0, 10, (batch,)))
