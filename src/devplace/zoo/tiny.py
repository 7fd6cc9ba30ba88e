"""Tiny models of the architectures a placement must run on (issue 30's matrix): transformers configurations
written here, random weights, small enough to place, export and run pipelined on a CPU in seconds.

Each factory takes `batch` and `seq_len` (images: `seq_len` is ignored) and returns `(module, example_inputs)`
as a zoo factory does, so each is a custom model name: `devplace place --model devplace.zoo.tiny:llama`.
Dropout is off everywhere, so a pipelined step and the unpipelined step compute the same numbers; the
BatchNorm CNN is the one model whose pipelined step differs (statistics per micro-batch).

- `llama`: a Llama-family decoder (rotary positions read by every layer, grouped-query attention);
- `neox`: a GPT-NeoX decoder (parallel residual, rotary on a quarter of each head);
- `bart`: an encoder-decoder (every decoder layer reads the encoder's output; tied embeddings);
- `mixtral`: a Mixtral-style decoder whose MLPs are top-2 mixtures of 4 experts;
- `cnn_bn`: a CNN with BatchNorm;
- `vit`: a Vision Transformer classifier.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from devplace.zoo.models import CausalLMLoss, LabelledLoss, _transformers

__all__ = ["ARCHITECTURES", "bart", "cnn_bn", "llama", "mixtral", "neox", "vit"]

VOCAB = 64
WIDTH = 32
LAYERS = 4  # enough module starts for 4 stages of whole layers


def _ids(batch: int, seq_len: int) -> torch.Tensor:
    return torch.randint(1, VOCAB, (batch, seq_len))


def llama(batch: int = 8, seq_len: int = 8) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """A Llama-family decoder."""
    tf = _transformers()
    cfg = tf.LlamaConfig(vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=2 * WIDTH, num_hidden_layers=LAYERS,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         attention_dropout=0.0, tie_word_embeddings=False)
    return CausalLMLoss(tf.LlamaForCausalLM(cfg)), (_ids(batch, seq_len),)


def neox(batch: int = 8, seq_len: int = 8) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """A GPT-NeoX decoder: parallel residual, rotary on a quarter of each head (Pythia's shape)."""
    tf = _transformers()
    cfg = tf.GPTNeoXConfig(vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=2 * WIDTH,
                           num_hidden_layers=LAYERS, num_attention_heads=4, rotary_pct=0.25,
                           use_parallel_residual=True, max_position_embeddings=64, attention_dropout=0.0,
                           hidden_dropout=0.0, tie_word_embeddings=False)
    return CausalLMLoss(tf.GPTNeoXForCausalLM(cfg)), (_ids(batch, seq_len),)


def bart(batch: int = 8, seq_len: int = 8) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """An encoder-decoder (BART): labels are the inputs, the decoder reads them shifted right."""
    tf = _transformers()
    cfg = tf.BartConfig(vocab_size=VOCAB, d_model=WIDTH, encoder_layers=2, decoder_layers=2,
                        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=2 * WIDTH,
                        decoder_ffn_dim=2 * WIDTH, max_position_embeddings=64, dropout=0.0, attention_dropout=0.0,
                        activation_dropout=0.0, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                        decoder_start_token_id=2, forced_eos_token_id=None)
    ids = _ids(batch, seq_len)
    return LabelledLoss(tf.BartForConditionalGeneration(cfg), use_cache=False), (ids, ids.clone())


def mixtral(batch: int = 8, seq_len: int = 8) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """A Mixtral-style decoder: each MLP a top-2 mixture of 4 experts."""
    tf = _transformers()
    cfg = tf.MixtralConfig(vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=2 * WIDTH,
                           num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
                           num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
                           attention_dropout=0.0, router_jitter_noise=0.0, tie_word_embeddings=False)
    return CausalLMLoss(tf.MixtralForCausalLM(cfg)), (_ids(batch, seq_len),)


class ConvBN(nn.Module):
    """A small CNN with BatchNorm: images, labels -> cross-entropy."""

    def __init__(self, classes: int = 5) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.block1 = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.block2 = nn.Sequential(nn.Conv2d(8, 16, 3, stride=2, padding=1), nn.BatchNorm2d(16), nn.ReLU())
        self.block3 = nn.Sequential(nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU())
        self.head = nn.Linear(16, classes)

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.block3(self.block2(self.block1(self.stem(images)))).mean(dim=(2, 3))
        return F.cross_entropy(self.head(h), labels)


def cnn_bn(batch: int = 8, seq_len: int | None = None) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """A CNN with BatchNorm on 8x8 images."""
    return ConvBN(), (torch.randn(batch, 3, 8, 8), torch.randint(0, 5, (batch,)))


class ImageLoss(nn.Module):
    """pixel_values, labels -> the HF image classifier's own loss."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, pixel_values: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.model(pixel_values=pixel_values, labels=labels).loss


def vit(batch: int = 8, seq_len: int | None = None) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """A Vision Transformer classifier on 16x16 images of 4x4 patches."""
    tf = _transformers()
    cfg = tf.ViTConfig(image_size=16, patch_size=4, num_channels=3, hidden_size=WIDTH, num_hidden_layers=LAYERS,
                       num_attention_heads=4, intermediate_size=2 * WIDTH, hidden_dropout_prob=0.0,
                       attention_probs_dropout_prob=0.0, num_labels=5)
    return ImageLoss(tf.ViTForImageClassification(cfg)), (torch.randn(batch, 3, 16, 16),
                                                           torch.randint(0, 5, (batch,)))


ARCHITECTURES: dict[str, Callable[..., tuple[nn.Module, tuple[Any, ...]]]] = {
    "llama": llama, "neox": neox, "bart": bart, "mixtral": mixtral, "cnn_bn": cnn_bn, "vit": vit}
