"""Character-level transformer language model on text shipped with Python.

The workload where Adam matters (issue 24: compressed Adam). Data are
``charlm-lstm``'s (:mod:`gradpress.workloads.charlm`): the first
``text_bytes`` (default 300 kB) of the sorted standard-library ``*.py``
sources, bytes as tokens (vocabulary 256), 90% / 10% train / held-out
split, non-overlapping windows of 64 + 1 bytes.

Model: a small decoder-only transformer (GPT-style, pre-norm): token
embedding (256 x ``hidden``) + learned position embedding (64 x
``hidden``) -> 2 causal self-attention blocks (4 heads, MLP 4 x
``hidden``, GELU, no dropout) -> LayerNorm -> linear to 256 logits. With
the default ``hidden = 128``: 0.47 M parameters. Metric: bits per
character on the held-out windows (cross-entropy / ln 2; lower is better).

Invariant: deterministic given the torch seed (the data do not depend on
the rank or the seed).
"""

from __future__ import annotations

import torch
from torch import nn

from gradpress.workloads.base import Workload, positive_int, split_cap
from gradpress.workloads.charlm import DEFAULT_BYTES, SEQ_LEN, bits_score, corpus, lm_loss, windows

LAYERS = 2
HEADS = 4


class CharTransformer(nn.Module):
    """Decoder-only transformer over bytes; see the module doc."""

    def __init__(self, hidden: int = 128, layers: int = LAYERS, heads: int = HEADS, vocab: int = 256,
                 context: int = SEQ_LEN) -> None:
        super().__init__()
        if hidden % heads:
            raise ValueError(f"charlm-transformer: hidden={hidden} must be a multiple of the {heads} heads")
        self.embed = nn.Embedding(vocab, hidden)
        self.pos = nn.Embedding(context, hidden)
        block = nn.TransformerEncoderLayer(hidden, heads, dim_feedforward=4 * hidden, dropout=0.0,
                                           activation="gelu", batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(context), persistent=False)
        nn.init.normal_(self.embed.weight, std=0.02)
        nn.init.normal_(self.pos.weight, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[1]
        h = self.embed(x) + self.pos.weight[:n]
        h = self.blocks(h, mask=self.mask[:n, :n], is_causal=True)
        return self.head(self.norm(h))


def build(*, hidden: int | None = None, samples: int | None = None, text_bytes: int | None = None,
          **_: object) -> Workload:
    width = 128 if hidden is None else positive_int("hidden", hidden)
    if width % HEADS:
        raise ValueError(f"charlm-transformer: hidden={width} must be a multiple of {HEADS} (the heads); "
                         f"allowed: 64, 128, 256, ...")
    budget = DEFAULT_BYTES if text_bytes is None else positive_int("text_bytes", text_bytes)
    text = corpus(budget)
    cut = int(0.9 * len(text))
    train, test = split_cap(windows(text[:cut], SEQ_LEN), windows(text[cut:], SEQ_LEN), samples)
    return Workload("charlm-transformer", CharTransformer(width), train, test, metric="bits_per_char",
                    higher_is_better=False, classifier=False, loss=lm_loss, score=bits_score,
                    info={"hidden": width, "text_bytes": len(text)})
