"""The zoo's named models as plain `nn.Module` factories, offline and randomly initialised.

`MODELS` maps a name to a `ModelSpec`; `spec.build(batch, seq_len)` returns `(module, example_inputs, loss_fn)`.

Contract of every factory (what `devplace.capture` and `devplace.runtime` rely on):
- `module(*example_inputs)` returns the **scalar training loss** of one batch (the targets are among the inputs:
  random class labels, the input tokens for a causal LM, masked tokens for BERT, a target sentence for the
  seq2seq models), so `loss_fn` is `None` for every zoo model; it is in the tuple so a caller can pass it on.
- The module is in training mode (dropout and batch-norm statistics active), float32.
- Nothing is downloaded: torchvision models with `weights=None`, transformers models from configs written
  here. Construction and the example inputs use only shape-level torch calls (no `.item()`, no rejection
  sampling), so `build` works inside `FakeTensorMode` and allocates no real memory there: that is how the
  big models (gpt2-xl, llama-1b) are captured.
- Randomness only through `seed` (torch's CPU generator is forked, so the caller's global RNG is untouched).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from devplace.errors import DevplaceError

LossFn = Callable[..., torch.Tensor]
Built = tuple[nn.Module, tuple[torch.Tensor, ...], LossFn | None]
Factory = Callable[[int, int | None], tuple[nn.Module, tuple[torch.Tensor, ...]]]


@dataclass(frozen=True)
class ModelSpec:
    """A named model: its factory, default batch and sequence length (None for images), parameter count."""

    name: str
    factory: Factory
    batch: int
    seq_len: int | None
    params: int
    description: str
    source: str  # "torchvision", "transformers" or "devplace"

    def build(self, batch: int | None = None, seq_len: int | None = None, *, seed: int = 0) -> Built:
        """(module, example_inputs, loss_fn=None) for `batch` x `seq_len` (defaults: the spec's)."""
        batch = self.batch if batch is None else int(batch)
        if batch < 1:
            raise DevplaceError(f"batch must be at least 1 for model {self.name!r}, got {batch}")
        if self.seq_len is None:
            if seq_len is not None:
                raise DevplaceError(f"model {self.name!r} takes images, not sequences: drop --seq-len")
        else:
            seq_len = self.seq_len if seq_len is None else int(seq_len)
            if seq_len < 2:
                raise DevplaceError(f"seq_len must be at least 2 for model {self.name!r}, got {seq_len}")
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            module, inputs = self.factory(batch, seq_len)
        module.train()
        return module, inputs, None


# ----------------------------------------------------------------------------------------------- wrappers

class ClassifierLoss(nn.Module):
    """images, labels -> cross-entropy of the wrapped classifier; an Inception auxiliary head, when the model
    returns one in training mode, adds 0.4 x its own cross-entropy (torchvision's Inception recipe)."""

    def __init__(self, model: nn.Module, aux_weight: float = 0.4):
        super().__init__()
        self.model = model
        self.aux_weight = aux_weight

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        out = self.model(images)
        if isinstance(out, tuple):  # torchvision's InceptionOutputs(logits, aux_logits)
            logits, aux = out
            loss = F.cross_entropy(logits, labels)
            return loss + self.aux_weight * F.cross_entropy(aux, labels) if aux is not None else loss
        return F.cross_entropy(out, labels)


class CausalLMLoss(nn.Module):
    """input_ids -> the HF causal LM's own next-token loss, with labels = the inputs (HF shifts them)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, labels=input_ids, use_cache=False).loss


class LabelledLoss(nn.Module):
    """input_ids, labels -> the HF model's own loss (masked LM for BERT, seq2seq LM for T5)."""

    def __init__(self, model: nn.Module, **extra: object):
        super().__init__()
        self.model = model
        self.extra = extra

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, labels=labels, **self.extra).loss


# ------------------------------------------------------------------------------------------- torchvision

def _images(batch: int, size: int, classes: int = 1000) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(batch, 3, size, size), torch.randint(0, classes, (batch,))


def _inception_v3(batch: int, seq_len: int | None) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    from torchvision.models import inception_v3

    # torchvision's own init draws a truncated normal by rejection sampling, which reads tensor values and so
    # cannot run under FakeTensorMode. Its bounds are +-2 (absolute) at std <= 0.1, i.e. >= 20 sigma: a plain
    # normal clamped to the bounds is the same distribution in practice, and shape-only.
    model = inception_v3(weights=None, aux_logits=True, init_weights=False)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.Conv2d | nn.Linear):
                std = float(getattr(m, "stddev", 0.1))
                m.weight.normal_(0.0, std).clamp_(-2.0, 2.0)
                if m.bias is not None:
                    m.bias.zero_()
            elif isinstance(m, nn.BatchNorm2d):
                m.weight.fill_(1.0)
                m.bias.zero_()
    return ClassifierLoss(model), _images(batch, 299)


def _torchvision(fn_name: str) -> Factory:
    def factory(batch: int, seq_len: int | None) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
        import torchvision.models

        model = getattr(torchvision.models, fn_name)(weights=None)
        return ClassifierLoss(model), _images(batch, 224)

    return factory


# ------------------------------------------------------------------------------------------ transformers

def _transformers() -> ModuleType:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers

    transformers.logging.set_verbosity_error()  # configs written here trip harmless warnings (loss_type)
    return transformers


def _gpt2_config(n_layer: int, n_embd: int, n_head: int, positions: int = 1024) -> Any:
    tf = _transformers()
    # Attention-probability dropout is off: with it on, PyTorch's CPU attention falls back to the unfused math
    # path, which materialises batch x heads x seq^2 scores that FlashAttention-style GPU kernels never store;
    # the captured graph would then overstate memory. Residual and embedding dropout stay at GPT-2's 0.1.
    return tf.GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=n_head, vocab_size=50257, n_positions=positions,
                         n_inner=None, activation_function="gelu_new", resid_pdrop=0.1, embd_pdrop=0.1,
                         attn_pdrop=0.0, layer_norm_epsilon=1e-5, tie_word_embeddings=True,
                         attn_implementation="sdpa")


def _gpt2(n_layer: int, n_embd: int, n_head: int, positions: int = 1024) -> Factory:
    """A GPT-2-architecture causal LM (learned positions, pre-LayerNorm, GELU MLP of 4 x n_embd, tied
    embeddings); GPT-3's dense models are this shape with `positions` = 2048 (Brown et al. 2020, table 2.1)."""
    def factory(batch: int, seq_len: int | None) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
        assert seq_len is not None
        if seq_len > positions:
            raise DevplaceError(f"this GPT model has {positions} positions; seq_len {seq_len} is too long")
        tf = _transformers()
        model = tf.GPT2LMHeadModel(_gpt2_config(n_layer, n_embd, n_head, positions))
        return CausalLMLoss(model), (torch.randint(0, 50257, (batch, seq_len)),)

    return factory


def _bert_base(batch: int, seq_len: int | None) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    assert seq_len is not None
    if seq_len > 512:
        raise DevplaceError(f"BERT has 512 positions; seq_len {seq_len} is too long")
    tf = _transformers()
    # BERT-base (Devlin et al. 2019); attention-probability dropout off for the reason given at GPT-2.
    config = tf.BertConfig(vocab_size=30522, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                           intermediate_size=3072, hidden_act="gelu", hidden_dropout_prob=0.1,
                           attention_probs_dropout_prob=0.0, max_position_embeddings=512, type_vocab_size=2,
                           tie_word_embeddings=True, attn_implementation="sdpa")
    model = tf.BertForMaskedLM(config)
    ids = torch.randint(0, 30522, (batch, seq_len))
    masked = torch.rand(batch, seq_len) < 0.15  # BERT's 15% of positions predicted; the rest ignored (-100)
    labels = torch.where(masked, ids, torch.full_like(ids, -100))
    return LabelledLoss(model), (ids, labels)


def _t5_small(batch: int, seq_len: int | None) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    assert seq_len is not None
    tf = _transformers()
    # T5-small as published (Raffel et al. 2020, v1.0): 6+6 layers, d_model 512, 8 heads of 64, d_ff 2048,
    # ReLU feed-forward, tied embeddings. T5 has no fused attention (relative position bias): eager.
    config = tf.T5Config(vocab_size=32128, d_model=512, d_kv=64, d_ff=2048, num_layers=6, num_decoder_layers=6,
                         num_heads=8, relative_attention_num_buckets=32, relative_attention_max_distance=128,
                         dropout_rate=0.1, feed_forward_proj="relu", tie_word_embeddings=True,
                         decoder_start_token_id=0, pad_token_id=0, eos_token_id=1, attn_implementation="eager")
    model = tf.T5ForConditionalGeneration(config)
    src = torch.randint(2, 32128, (batch, seq_len))
    tgt = torch.randint(2, 32128, (batch, seq_len))  # decoder inputs = labels shifted right, by T5 itself
    return LabelledLoss(model, use_cache=False), (src, tgt)


def _llama(hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int, vocab: int, tied: bool,
           rope: dict[str, Any], positions: int, bos: int, eos: int) -> Factory:
    """A Llama-architecture causal LM (transformers LlamaConfig: RMSNorm, SwiGLU MLP, RoPE, grouped-query
    attention with `kv_heads`, head size hidden / heads), attention dropout off, SDPA attention."""
    def factory(batch: int, seq_len: int | None) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
        assert seq_len is not None
        tf = _transformers()
        config = tf.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                                num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                                head_dim=hidden // heads, hidden_act="silu", max_position_embeddings=positions,
                                rms_norm_eps=1e-5, tie_word_embeddings=tied, **rope, attention_dropout=0.0,
                                bos_token_id=bos, eos_token_id=eos, attn_implementation="sdpa")
        model = tf.LlamaForCausalLM(config)
        return CausalLMLoss(model), (torch.randint(0, vocab, (batch, seq_len)),)

    return factory


LLAMA3_ROPE = {"rope_theta": 500000.0}  # Llama 3's RoPE base; 3.1/3.2 add the "llama3" frequency scaling
LLAMA31_ROPE = {**LLAMA3_ROPE, "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}
# Llama 3.2 1B's published shape: 16 layers, hidden 2048, MLP 8192 (SwiGLU), 32 query heads and 8 key/value heads
# of 64 (grouped-query attention), vocab 128256, tied embeddings, RoPE theta 5e5 with llama3 scaling.
_llama_1b = _llama(2048, 8192, 16, 32, 8, 128256, True, LLAMA31_ROPE, 131072, 128000, 128001)
# Meta-Llama-3-8B's published config: 32 layers, hidden 4096, MLP 14336, 32 query and 8 key/value heads of 128,
# vocab 128256, untied embeddings, RoPE theta 5e5, 8192 positions: 8,030,261,248 parameters.
_llama3_8b = _llama(4096, 14336, 32, 32, 8, 128256, False, LLAMA3_ROPE, 8192, 128000, 128001)
# Llama-2-13B's published config: 40 layers, hidden 5120, MLP 13824, 40 heads of 128 (no grouped-query
# attention), vocab 32000, untied embeddings, RoPE theta 1e4, 4096 positions: 13,015,864,320 parameters.
_llama2_13b = _llama(5120, 13824, 40, 40, 40, 32000, False, {"rope_theta": 10000.0}, 4096, 1, 2)


# ----------------------------------------------------------------------------------------------- GNMT

class AdditiveAttention(nn.Module):
    """Normalised Bahdanau attention as in GNMT: score(q, k) = g * v/|v| . tanh(W_q q + W_k k + b), softmax
    over source positions, context = weighted sum of the keys. Computed for all target positions at once."""

    def __init__(self, query_size: int, key_size: int, units: int):
        super().__init__()
        self.linear_q = nn.Linear(query_size, units, bias=False)
        self.linear_k = nn.Linear(key_size, units, bias=False)
        self.bias = nn.Parameter(torch.zeros(units))
        bound = units ** -0.5
        self.v = nn.Parameter(torch.empty(units).uniform_(-bound, bound))
        self.g = nn.Parameter(torch.full((), bound))

    def forward(self, query: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        q = self.linear_q(query).unsqueeze(2)  # b, t, 1, u
        k = self.linear_k(keys).unsqueeze(1)  # b, 1, s, u
        v = self.g * self.v / self.v.norm()
        scores = torch.tanh(q + k + self.bias) @ v  # b, t, s
        return torch.bmm(F.softmax(scores, dim=-1), keys)  # b, t, key_size


class GNMT(nn.Module):
    """GNMT (Wu et al. 2016) in the batched training form of its public PyTorch re-implementations ("GNMT v2"):
    8 encoder LSTM layers (the first bidirectional, 1024 units per direction), 8 decoder LSTM layers,
    residual connections from the third layer on, additive attention from the bottom decoder layer, its
    context fed to every decoder layer above, a softmax over 32000 word pieces; label-smoothed cross-entropy."""

    def __init__(self, vocab: int = 32000, hidden: int = 1024, enc_layers: int = 8, dec_layers: int = 8,
                 dropout: float = 0.2, label_smoothing: float = 0.1):
        super().__init__()
        if enc_layers < 2 or dec_layers < 2:
            raise DevplaceError("GNMT needs at least 2 encoder and 2 decoder layers")
        self.vocab = vocab
        self.label_smoothing = label_smoothing
        self.dropout = nn.Dropout(dropout)
        self.src_embedding = nn.Embedding(vocab, hidden)
        self.encoder = nn.ModuleList(
            [nn.LSTM(hidden, hidden, batch_first=True, bidirectional=True),
             nn.LSTM(2 * hidden, hidden, batch_first=True)]
            + [nn.LSTM(hidden, hidden, batch_first=True) for _ in range(enc_layers - 2)])
        self.tgt_embedding = nn.Embedding(vocab, hidden)
        self.att_rnn = nn.LSTM(hidden, hidden, batch_first=True)
        self.attention = AdditiveAttention(hidden, hidden, hidden)
        self.decoder = nn.ModuleList([nn.LSTM(2 * hidden, hidden, batch_first=True) for _ in range(dec_layers - 1)])
        self.classifier = nn.Linear(hidden, vocab)

    def encode(self, src: torch.Tensor) -> torch.Tensor:
        x = self.dropout(self.src_embedding(src))
        for i, rnn in enumerate(self.encoder):
            residual = x
            x, _ = rnn(self.dropout(x) if i > 0 else x)
            if i >= 2:
                x = x + residual
        return x

    def decode(self, tgt_in: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        x, _ = self.att_rnn(self.dropout(self.tgt_embedding(tgt_in)))
        context = self.attention(x, memory)
        for i, rnn in enumerate(self.decoder):
            residual = x
            x, _ = rnn(torch.cat([self.dropout(x), context], dim=-1))
            if i >= 1:  # decoder layer index i + 1 >= 2: residual from the third layer on
                x = x + residual
        return self.classifier(x)

    def forward(self, src: torch.Tensor, tgt_in: torch.Tensor, tgt_out: torch.Tensor) -> torch.Tensor:
        logits = self.decode(tgt_in, self.encode(src))
        return F.cross_entropy(logits.reshape(-1, self.vocab), tgt_out.reshape(-1),
                               label_smoothing=self.label_smoothing)


def _gnmt(batch: int, seq_len: int | None) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    assert seq_len is not None
    model = GNMT()
    src, tgt_in, tgt_out = (torch.randint(0, 32000, (batch, seq_len)) for _ in range(3))
    return model, (src, tgt_in, tgt_out)


# ---------------------------------------------------------------------------------------------- registry

def _spec(name: str, factory: Factory, batch: int, seq_len: int | None, params: int, what: str,
          source: str) -> ModelSpec:
    size = f"{params / 1e9:.2f}B" if params >= 1e9 else f"{params / 1e6:.1f}M"
    shape = f"batch {batch}, seq {seq_len}" if seq_len is not None else f"batch {batch}"
    return ModelSpec(name, factory, batch, seq_len, params, f"{what}; {size} parameters; {shape}", source)


MODELS: dict[str, ModelSpec] = {s.name: s for s in [
    _spec("inception_v3", _inception_v3, 32, None, 27_161_264,
          "Inception-v3 (torchvision), 299x299, with auxiliary classifier", "torchvision"),
    _spec("resnet50", _torchvision("resnet50"), 32, None, 25_557_032, "ResNet-50 (torchvision), 224x224",
          "torchvision"),
    _spec("vgg16", _torchvision("vgg16"), 32, None, 138_357_544, "VGG-16 (torchvision), 224x224", "torchvision"),
    _spec("mobilenet_v3_large", _torchvision("mobilenet_v3_large"), 32, None, 5_483_032,
          "MobileNetV3-Large (torchvision), 224x224", "torchvision"),
    _spec("bert-base", _bert_base, 32, 128, 109_514_298, "BERT-base masked LM (transformers)", "transformers"),
    _spec("gpt2", _gpt2(12, 768, 12), 8, 1024, 124_439_808, "GPT-2 small causal LM (transformers)",
          "transformers"),
    _spec("gpt2-xl", _gpt2(48, 1600, 25), 4, 1024, 1_557_611_200, "GPT-2 XL causal LM (transformers)",
          "transformers"),
    _spec("t5-small", _t5_small, 32, 128, 60_506_624, "T5-small seq2seq LM (transformers), target length = seq",
          "transformers"),
    _spec("llama-1b", _llama_1b, 4, 2048, 1_235_814_400,
          "Llama-3.2-1B-shaped decoder (transformers LlamaConfig), causal LM", "transformers"),
    _spec("llama3-8b", _llama3_8b, 1, 8192, 8_030_261_248,
          "Meta-Llama-3-8B-shaped decoder (transformers LlamaConfig), causal LM", "transformers"),
    _spec("llama-13b", _llama2_13b, 1, 4096, 13_015_864_320,
          "Llama-2-13B-shaped decoder (transformers LlamaConfig), causal LM", "transformers"),
    _spec("gpt3-1.3b", _gpt2(24, 2048, 16, positions=2048), 8, 2048, 1_315_723_264,
          "GPT-3 1.3B-shaped causal LM (GPT-2 architecture, 2048 positions; transformers)", "transformers"),
    _spec("gnmt", _gnmt, 128, 50, 276_735_233, "GNMT 8+8-layer LSTM encoder-decoder with attention (devplace), "
          "vocab 32000, source = target length = seq", "devplace"),
]}


def model_names() -> list[str]:
    """The zoo's model names, in registry order."""
    return list(MODELS)


def get_spec(name: str) -> ModelSpec:
    """The spec of a named model; a DevplaceError naming the known models otherwise."""
    try:
        return MODELS[name]
    except KeyError:
        raise DevplaceError(f"unknown zoo model {name!r}; known models: {', '.join(MODELS)}") from None


def build_model(name: str, batch: int | None = None, seq_len: int | None = None, *, seed: int = 0) -> Built:
    """(module, example_inputs, loss_fn=None) of a named model; see the module docstring for the contract."""
    return get_spec(name).build(batch, seq_len, seed=seed)
