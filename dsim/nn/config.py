"""The `model:` section: which network is trained, and the Transformer's sizes (dsim.nn.models builds it)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..section import ConfigError, key, need

MAX_WIDTH = 1 << 16  # a wider layer would not fit in memory on any machine dsim runs on


def _models():
    from .models import MODELS
    return MODELS


@dataclass
class TransformerConfig:
    """The distributed page's sample Transformer (its defaults)."""
    vocab_size: int = key(20000, "vocabulary size of each side (source and target)", ">= 4")
    d_model: int = key(128, "width of the embeddings and of every block", ">= 1")
    num_heads: int = key(8, "attention heads (divisible by model_parallel)", ">= 1")
    ffn_hidden_size: Optional[int] = key(None, "width of the feed-forward layer; null: d_model, as the sample",
                                         ">= 1 or null")
    encoder_layers: int = key(1, "encoder blocks", ">= 1")
    decoder_layers: int = key(1, "decoder blocks", ">= 1")
    src_len: int = key(10, "source sequence length in tokens", ">= 1")
    tgt_len: int = key(10, "target sequence length in tokens", ">= 1")
    max_position: Optional[int] = key(None, "size of the position table; null: the longer of src_len and tgt_len",
                                      ">= 1 or null")

    def validate(self) -> None:
        for name in ("vocab_size", "d_model", "num_heads", "ffn_hidden_size", "encoder_layers", "decoder_layers",
                     "src_len", "tgt_len", "max_position"):
            value, low = getattr(self, name), 4 if name == "vocab_size" else 1
            if value is not None and value < low:
                raise ConfigError(f"config: model.transformer.{name} must be >= {low}, got {value}")


@dataclass
class ModelConfig:
    """Which network is trained."""
    name: str = key("network", "the network: the last-gasp page's MLP (network), the UCE page's (uce_network), "
                               "LeNet5 or the distributed page's Transformer", _models)
    hidden: Optional[list[int]] = key(None, "MLPs: the hidden widths instead of the model's, e.g. [64, 128, 128, 64]",
                                      "widths 1 to 65536, or null")
    transformer: TransformerConfig = key(doc="the Transformer's sizes (model.name: transformer)",
                                         factory=TransformerConfig)

    def validate(self) -> None:
        models = _models()
        need(self.name in models, "model.name", f"one of {', '.join(models)}", self.name)
        h = self.hidden
        if h is not None and not all(w >= 1 for w in h):
            raise ConfigError(f"config: model.hidden widths must be >= 1, got {h}")
        self.transformer.validate()
        if h is not None:
            need(len(h) >= 1, "model.hidden", "a list of one or more widths", h)
            need(all(w <= MAX_WIDTH for w in h), "model.hidden", f"widths <= {MAX_WIDTH}", h)
