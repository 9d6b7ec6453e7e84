"""Character-level LSTM language model on text shipped with Python itself.

Text: the standard library's top-level ``*.py`` sources
(``sysconfig.get_paths()["stdlib"]``), read in sorted file-name order and
concatenated until a fixed byte budget (default 300 kB), so the corpus is the
same on every rank and every run of one Python version. Tokens are bytes
(vocabulary 256). The first 90% is training text, the last 10% held out.
Samples are non-overlapping windows of ``seq_len + 1`` bytes (input, and the
input shifted by one as target).

Model: embedding (256 x 32) -> one-layer LSTM (``hidden``, default 128) ->
linear to 256 logits. Metric: bits per character on the held-out windows
(cross-entropy / ln 2; lower is better).
"""

from __future__ import annotations

import math
import sysconfig
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from gradpress.workloads.base import Workload, positive_int, split_cap

DEFAULT_BYTES = 300_000
SEQ_LEN = 64


def corpus(budget: int = DEFAULT_BYTES) -> bytes:
    """The first ``budget`` bytes of the sorted standard-library sources."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.glob("*.py") if p.is_file())
    if not files:
        raise ValueError(f"charlm-lstm: no .py files found in the standard library directory {root}")
    parts: list[bytes] = []
    total = 0
    for path in files:
        data = path.read_bytes()
        parts.append(data[: budget - total])
        total += len(parts[-1])
        if total >= budget:
            break
    return b"".join(parts)


def windows(text: bytes, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    arr = np.frombuffer(text, dtype=np.uint8).astype(np.int64)
    n = (len(arr) - 1) // seq_len
    if n < 1:
        raise ValueError(f"charlm-lstm: text of {len(arr)} bytes is too short for seq_len={seq_len}")
    x = arr[: n * seq_len].reshape(n, seq_len)
    y = arr[1 : n * seq_len + 1].reshape(n, seq_len)
    return torch.from_numpy(x.copy()), torch.from_numpy(y.copy())


class CharLSTM(nn.Module):
    def __init__(self, hidden: int = 128, embed: int = 32, vocab: int = 256) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, embed)
        self.lstm = nn.LSTM(embed, hidden, batch_first=True)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = self.lstm(self.embed(x))
        return self.head(h)


def lm_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1))


def bits_score(output: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(total negative log2-likelihood of the targets, number of characters)."""
    nll = F.cross_entropy(output.reshape(-1, output.shape[-1]).double(), target.reshape(-1), reduction="sum")
    return nll / math.log(2.0), int(target.numel())


def build(*, hidden: int | None = None, samples: int | None = None, text_bytes: int | None = None,
          **_: object) -> Workload:
    width = 128 if hidden is None else positive_int("hidden", hidden)
    budget = DEFAULT_BYTES if text_bytes is None else positive_int("text_bytes", text_bytes)
    text = corpus(budget)
    cut = int(0.9 * len(text))
    train, test = split_cap(windows(text[:cut], SEQ_LEN), windows(text[cut:], SEQ_LEN), samples)
    return Workload("charlm-lstm", CharLSTM(width), train, test, metric="bits_per_char", higher_is_better=False,
                    classifier=False, loss=lm_loss, score=bits_score, info={"hidden": width, "text_bytes": len(text)})
