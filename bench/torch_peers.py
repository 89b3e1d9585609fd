"""dsim's benchmark models written in torch, layer for layer, to time beside dsim (the `bench` extra).

    model = peer(cfg); opt = optimizer(cfg, model); ends = train(comm, model, opt, batch, steps)

Each model's forward takes a batch as dsim's loader gives it (numpy inputs and labels, turned into tensors
once) and returns the mean loss. Sizes, initial scale, dtype and optimizer follow the dsim config; torch runs
one thread per rank (torch.set_num_threads(1), as every dsim rank has one BLAS thread) and, on several ranks,
DistributedDataParallel on gloo over 127.0.0.1. Only the time per step is compared: the initial values differ.
"""
from __future__ import annotations

import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dsim.data.translation import PAD
from dsim.nn.attention import MASKED
from dsim.nn.network import ARCHITECTURES
from dsim.optim.optimizers import decays


class MLP(nn.Module):
    """The default run's Network: layer1 a MatMulCell (no bias), ReLU between the layers."""

    def __init__(self, cfg):
        super().__init__()
        widths = [28 * 28, *(cfg.model.hidden or ARCHITECTURES[cfg.model.name]), 10]
        layers = []
        for i in range(len(widths) - 1):
            layers.append(nn.Linear(widths[i], widths[i + 1], bias=i > 0))
            if i < len(widths) - 2:
                layers.append(nn.ReLU())
        self.net = nn.Sequential(*layers)

    def forward(self, x, labels):
        return F.cross_entropy(self.net(x.reshape(x.shape[0], -1)), labels)


class LeNet5(nn.Module):
    """dsim.nn.lenet with torch's own convolution and pooling: conv 1->6 and 6->16 (5x5, valid, no bias)."""

    def __init__(self, cfg):
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(1, 6, 5, bias=False), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(6, 16, 5, bias=False), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
            nn.Linear(16 * 5 * 5, 120), nn.ReLU(), nn.Linear(120, 84), nn.ReLU(), nn.Linear(84, 10))

    def forward(self, x, labels):
        return F.cross_entropy(self.net(x), labels)


class Attention(nn.Module):
    """Q, K, V and the output projection (Linear with bias each), scaled dot product with an additive mask."""

    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.projection = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x, memory, mask):
        b, d = x.shape[0], x.shape[-1]
        split = lambda t: t.view(b, -1, self.heads, d // self.heads).transpose(1, 2)  # noqa: E731
        ctx = F.scaled_dot_product_attention(split(self.q(x)), split(self.k(memory)), split(self.v(memory)), mask)
        return self.projection(ctx.transpose(1, 2).reshape(b, -1, d))


def feed_forward(d, ffn):
    return nn.Sequential(nn.Linear(d, ffn), nn.GELU(approximate="tanh"), nn.Linear(ffn, d))


class EncoderLayer(nn.Module):
    def __init__(self, d, heads, ffn):
        super().__init__()
        self.layernorm1, self.attention = nn.LayerNorm(d), Attention(d, heads)
        self.layernorm2, self.output = nn.LayerNorm(d), feed_forward(d, ffn)

    def forward(self, x, mask):
        y = self.layernorm1(x)
        h = x + self.attention(y, y, mask)
        return h + self.output(self.layernorm2(h))


class DecoderLayer(nn.Module):
    def __init__(self, d, heads, ffn):
        super().__init__()
        self.layernorm1, self.attention = nn.LayerNorm(d), Attention(d, heads)
        self.cross_attention_layernorm, self.cross_attention = nn.LayerNorm(d), Attention(d, heads)
        self.layernorm2, self.output = nn.LayerNorm(d), feed_forward(d, ffn)

    def forward(self, x, memory, self_mask, memory_mask):
        y = self.layernorm1(x)
        h1 = x + self.attention(y, y, self_mask)
        h2 = h1 + self.cross_attention(self.cross_attention_layernorm(h1), memory, memory_mask)
        return h2 + self.output(self.layernorm2(h2))


class Transformer(nn.Module):
    """dsim.nn.transformer: word and position embeddings on both sides, pre-LayerNorm blocks, a head without
    bias to the vocabulary, cross-entropy over the target tokens that are not padding."""

    def __init__(self, cfg):
        super().__init__()
        t = cfg.model.transformer
        d, ffn = t.d_model, t.ffn_hidden_size or t.d_model
        positions = max(t.src_len, t.tgt_len)
        self.src_word, self.src_position = nn.Embedding(t.vocab_size, d), nn.Embedding(positions, d)
        self.tgt_word, self.tgt_position = nn.Embedding(t.vocab_size, d), nn.Embedding(positions, d)
        self.encoder = nn.ModuleList(EncoderLayer(d, t.num_heads, ffn) for _ in range(t.encoder_layers))
        self.decoder = nn.ModuleList(DecoderLayer(d, t.num_heads, ffn) for _ in range(t.decoder_layers))
        self.head = nn.Linear(d, t.vocab_size, bias=False)

    @staticmethod
    def _embed(word, position, ids):
        return word(ids) + position(torch.arange(ids.shape[1]))

    def forward(self, inputs, labels):
        src, tgt = inputs
        src_keys = torch.where(src != PAD, 0.0, MASKED)[:, None, None, :]
        causal = torch.where(torch.ones(tgt.shape[1], tgt.shape[1], dtype=torch.bool).tril(), 0.0, MASKED)
        self_mask = torch.minimum(causal, torch.where(tgt != PAD, 0.0, MASKED)[:, None, None, :])
        memory = self._embed(self.src_word, self.src_position, src)
        for block in self.encoder:
            memory = block(memory, src_keys)
        y = self._embed(self.tgt_word, self.tgt_position, tgt)
        for block in self.decoder:
            y = block(y, memory, self_mask, src_keys)
        logits = self.head(y).reshape(-1, self.head.out_features)
        mask = (tgt != PAD).reshape(-1)
        losses = F.cross_entropy(logits, labels.reshape(-1), reduction="none")
        return (losses * mask).sum() / mask.sum().clamp(min=1)


PEERS = {"network": MLP, "uce_network": MLP, "lenet5": LeNet5, "transformer": Transformer}


def peer(cfg) -> nn.Module:
    """The torch model of a dsim config, in its dtype."""
    torch.set_num_threads(1)
    torch.manual_seed(cfg.seed)
    return PEERS[cfg.model.name](cfg).to(torch.float64 if cfg.dtype == "float64" else torch.float32)


def optimizer(cfg, params, fused=None) -> torch.optim.Optimizer:
    """torch's counterpart of the config's optimizer on (name, parameter) pairs: SGD with momentum for
    momentum, Adam, AdamW with dsim's decay group (not LayerNorm, not biases) for adamweightdecay.
    fused=True: torch's fused implementation (one C++ pass per parameter); None: torch's default."""
    o, params = cfg.optimizer, list(params)
    tensors = [p for _, p in params]
    if o.name == "sgd":
        return torch.optim.SGD(tensors, lr=o.learning_rate, weight_decay=o.weight_decay, fused=fused)
    if o.name == "momentum":
        return torch.optim.SGD(tensors, lr=o.learning_rate, momentum=o.momentum, weight_decay=o.weight_decay,
                               fused=fused)
    if o.name == "adam":
        return torch.optim.Adam(tensors, lr=o.learning_rate, betas=(o.beta1, o.beta2), eps=o.eps,
                                weight_decay=o.weight_decay, fused=fused)
    if o.name == "adamweightdecay":
        groups = [{"params": [p for n, p in params if decays(n)], "weight_decay": o.weight_decay},
                  {"params": [p for n, p in params if not decays(n)], "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=o.learning_rate, betas=(o.beta1, o.beta2), eps=o.eps, fused=fused)
    raise ValueError(f"no torch optimizer for {o.name!r}")


def tensors(batch):
    """A loader's batch (inputs, labels; inputs a pair for the Transformer) as tensors."""
    inputs, labels = batch
    convert = lambda a: torch.from_numpy(np.ascontiguousarray(a))  # noqa: E731
    inputs = tuple(convert(a) for a in inputs) if isinstance(inputs, tuple) else convert(inputs)
    return inputs, convert(labels)


def data_parallel(comm, model: nn.Module, port: int) -> nn.Module:
    """model under DistributedDataParallel (gloo, 127.0.0.1:port) over comm's ranks; itself on one rank."""
    if comm.size == 1:
        return model
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=comm.rank, world_size=comm.size)
    return nn.parallel.DistributedDataParallel(model)


def train(comm, model, opt, batch, steps: int) -> dict:
    """Train `steps` steps on one batch: the end time of every step and the time of each optimizer.step()."""
    inputs, labels = tensors(batch)
    comm.Barrier()
    ends, updates = [], []
    for _ in range(steps):
        opt.zero_grad(set_to_none=False)
        model(inputs, labels).backward()
        t = time.perf_counter()
        opt.step()
        ends.append(time.perf_counter())
        updates.append(ends[-1] - t)
    comm.Barrier()
    return {"ends": ends, "updates": updates}
