"""The autoencoder of Learned Gradient Compression (LGC).

Abrahamyan, Chen, Bekoulis, Deligiannis, "Learned Gradient Compression for
Distributed Deep Learning", IEEE TNNLS 2021: a small 1-D convolutional
encoder maps the k values a node selected by top-k (one vector for the whole
model, in the order of the master's decreasing values: a monotone curve for
the master, a noisy copy of it for the others) to a latent about k/4 long; one decoder per node
(parameter-server variant) or one shared decoder (ring variant) maps a
latent back to k values. Trained online during phase 2 on the values every
node already holds after the exchange, with

    loss = w_rec * mean_j MSE(dec_j(enc(x_j)), x_j) + w_sim * mean_j MSE(enc(x_j), mean_i enc(x_i))

(w_rec = w_sim = 0.5 as in the paper). The paper's similarity term compares
the nodes' latents pairwise; the distance to their mean is the same quantity
up to a factor (sum_{i<j} |z_i - z_j|^2 = N sum_j |z_j - z_bar|^2).

Choices where the paper is silent (docs/lgc.md):

* Scale: the encoder sees ``x / s`` and the decoder's output is multiplied
  by ``s``, with ``s`` the RMS of the master's (leader's) values, so the
  codec does not depend on the gradient's magnitude, which shrinks over
  training; ``s`` travels with the latent (4 bytes).
* Architecture: Conv1d(1,c,5) -> LeakyReLU -> Conv1d(c,c,4,stride 2) ->
  LeakyReLU -> Conv1d(c,1,4,stride 2) (latent = ceil(k/4)); the decoders
  mirror it with transposed convolutions. The input is zero-padded to a
  multiple of 4 and the output cropped back to k.

Invariants: built from a seed (every rank builds the same weights without
touching the global RNG); training is a pure function of the weights, the
optimizer state and the batch, so ranks fed the same batch stay identical.
"""

from __future__ import annotations

import math

import torch
from torch import nn

__all__ = ["LGCAutoencoder", "latent_length", "rms", "train_step"]

_SLOPE = 0.1


def latent_length(k: int) -> int:
    """The latent length for k selected values: ceil(k / 4)."""
    return math.ceil(k / 4)


def _encoder(c: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv1d(1, c, 5, padding=2), nn.LeakyReLU(_SLOPE),
        nn.Conv1d(c, c, 4, stride=2, padding=1), nn.LeakyReLU(_SLOPE),
        nn.Conv1d(c, 1, 4, stride=2, padding=1),
    )


def _decoder(c: int) -> nn.Sequential:
    return nn.Sequential(
        nn.ConvTranspose1d(1, c, 4, stride=2, padding=1), nn.LeakyReLU(_SLOPE),
        nn.ConvTranspose1d(c, c, 4, stride=2, padding=1), nn.LeakyReLU(_SLOPE),
        nn.Conv1d(c, 1, 5, padding=2),
    )


class LGCAutoencoder(nn.Module):
    """Encoder of k values to ``latent_length(k)`` and ``decoders`` decoders.

    ``encode(x)``: (B, k) -> (B, L); ``decode(z, j)``: (B, L) -> (B, k) with
    decoder j; ``decode_all(z)``: (L,) -> (decoders, k), every decoder on the
    same latent. Works in float32 whatever the model's dtype.
    """

    def __init__(self, k: int, decoders: int, channels: int = 8, seed: int = 0) -> None:
        super().__init__()
        if k < 4:
            raise ValueError(f"lgc autoencoder: k (selected values) must be >= 4 for a latent, got {k}")
        self.k = k
        self.latent = latent_length(k)
        self.padded = 4 * self.latent
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.encoder = _encoder(channels)
            self.decoders = nn.ModuleList(_decoder(channels) for _ in range(decoders))

    def _pad(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.pad(x.float(), (0, self.padded - self.k)).unsqueeze(1)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return self.encoder(self._pad(x)).squeeze(1)

    def decode(self, z: torch.Tensor, j: int) -> torch.Tensor:
        return self.decoders[j](z.float().unsqueeze(1)).squeeze(1)[:, : self.k]

    def decode_all(self, z: torch.Tensor) -> torch.Tensor:
        z = z.reshape(1, -1)
        return torch.cat([self.decode(z, j) for j in range(len(self.decoders))])

    def losses(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(reconstruction, similarity) on a batch ``x`` (N, k), row j being
        node j's values: with one decoder per node row j goes through decoder
        j, with one shared decoder every row goes through it."""
        z = self.encode(x)
        if len(self.decoders) == 1:
            rec = self.decode(z, 0)
        else:
            if len(self.decoders) != x.shape[0]:
                raise ValueError(f"lgc autoencoder: batch of {x.shape[0]} rows for {len(self.decoders)} decoders")
            rec = torch.cat([self.decode(z[j : j + 1], j) for j in range(x.shape[0])])
        mse = nn.functional.mse_loss
        return mse(rec, x.float()), mse(z, z.mean(0, keepdim=True).expand_as(z))


def rms(x: torch.Tensor) -> torch.Tensor:
    """Root mean square of ``x`` as a float32 scalar tensor, never zero."""
    return x.float().pow(2).mean().sqrt().clamp_min(torch.finfo(torch.float32).tiny)


def train_step(ae: LGCAutoencoder, optimizer: torch.optim.Optimizer, x: torch.Tensor, *, w_rec: float = 0.5,
               w_sim: float = 0.5, iters: int = 1) -> torch.Tensor:
    """``iters`` optimizer steps of the LGC loss on the batch ``x`` (N, k),
    already scaled; returns the loss before the first step (a detached
    float32 scalar tensor: no host sync here)."""
    first = None
    with torch.enable_grad():
        for _ in range(iters):
            optimizer.zero_grad(set_to_none=True)
            rec, sim = ae.losses(x)
            loss = w_rec * rec + w_sim * sim
            loss.backward()
            optimizer.step()
            if first is None:
                first = loss.detach()
    assert first is not None
    return first
