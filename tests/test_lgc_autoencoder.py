"""LGC's autoencoder (Abrahamyan et al. 2021) on correlated synthetic
gradients: a shared signal plus small per-node noise. Its loss falls, and
the reconstruction of the averaged gradient from the master's latent (PS
variant) beats top-k at the same byte budget per node. The references
(top-k, relative errors) are computed here in float64."""

from __future__ import annotations

import pytest
import torch
from references import topk_indices

from gradpress.algorithms.lgc_autoencoder import LGCAutoencoder, latent_length, rms, train_step
from gradpress.algorithms.lgc_exchange import select

D, K, N = 4096, 128, 4
CENTERS = (500.0, 1700.0, 3000.0)


def sample(g: torch.Generator) -> torch.Tensor:
    """(N, D) float64: a shared signal (three smooth bumps with random
    amplitudes, a little background) plus per-node noise of 5%."""
    pos = torch.arange(D, dtype=torch.float64)
    a = torch.randn(len(CENTERS), generator=g, dtype=torch.float64)
    shared = sum(a[b] * torch.exp(-0.5 * ((pos - c) / 25.0) ** 2) for b, c in enumerate(CENTERS))
    shared = shared + 0.02 * torch.randn(D, generator=g, dtype=torch.float64)
    return shared + 0.05 * torch.randn(N, D, generator=g, dtype=torch.float64)


def test_latent_is_a_quarter_and_shapes() -> None:
    ae = LGCAutoencoder(106, 3, 4, seed=0)
    assert ae.latent == latent_length(106) == 27
    z = ae.encode(torch.randn(5, 106))
    assert z.shape == (5, 27)
    assert ae.decode(z, 2).shape == (5, 106)
    assert ae.decode_all(z[0]).shape == (3, 106)
    with pytest.raises(ValueError, match="k"):
        LGCAutoencoder(3, 1)
    with pytest.raises(ValueError, match="lgc autoencoder: batch of 2 rows for 3 decoders"):
        LGCAutoencoder(106, 3, 4, seed=0).losses(torch.randn(2, 106))


def test_same_seed_same_weights_and_global_rng_untouched() -> None:
    torch.manual_seed(1)
    before = torch.get_rng_state()
    a, b = LGCAutoencoder(64, 2, seed=5), LGCAutoencoder(64, 2, seed=5)
    assert torch.equal(torch.get_rng_state(), before)
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)


def test_autoencoder_learns_and_beats_topk_at_the_same_bytes() -> None:
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(1)
    ae = LGCAutoencoder(K, N, 8, seed=1)
    opt = torch.optim.Adam(ae.parameters(), lr=3e-3)
    losses = []
    for _ in range(500):  # phase 2: train on the values every node holds at the master's indices
        grads = sample(g)
        idx = select(grads[0], [(0, D, K)]).long()  # the master's indices, in its order of decreasing value
        losses.append(float(train_step(ae, opt, (grads[:, idx] / rms(grads[0, idx])).float())))
    first, last = sum(losses[:20]) / 20, sum(losses[-20:]) / 20
    assert last < 0.1 * first, (first, last)

    # phase 3 (PS): the master's indices + latent + scale; everyone decodes every node's estimate
    budget = 4 * K + 4 * ae.latent + 4  # bytes the master sends
    k_topk = budget // 8  # top-k: 4-byte value + 4-byte index per entry, same bytes per node
    err_lgc, err_topk = [], []
    with torch.no_grad():
        for _ in range(30):
            grads = sample(g)
            mean = grads.mean(0)
            idx = select(grads[0], [(0, D, K)]).long()
            assert torch.equal(idx.sort().values, topk_indices(grads[0], K))
            scale = rms(grads[0, idx])
            z = ae.encode((grads[0:1, idx] / scale).float())[0]
            estimate = torch.zeros(D, dtype=torch.float64)
            estimate[idx] = (ae.decode_all(z).double() * float(scale)).mean(0)
            err_lgc.append(float((estimate - mean).norm() / mean.norm()))
            sparse = torch.zeros(D, dtype=torch.float64)
            for j in range(N):
                i = topk_indices(grads[j], k_topk)
                sparse[i] += grads[j, i] / N
            err_topk.append(float((sparse - mean).norm() / mean.norm()))
    lgc, topk = sum(err_lgc) / len(err_lgc), sum(err_topk) / len(err_topk)
    assert lgc < 0.9 * topk, (lgc, topk)


@pytest.mark.parametrize("quotas", [[(0, 300, 7)], [(0, 100, 3), (100, 150, 1), (250, 50, 5)]])
def test_select_keeps_each_segments_largest_in_decreasing_value_order(quotas: list[tuple[int, int, int]]) -> None:
    acc = torch.randn(300, generator=torch.Generator().manual_seed(4))
    idx = select(acc, quotas).long()
    expected = torch.cat([topk_indices(acc[o:o + n], q) + o for o, n, q in quotas])
    assert torch.equal(idx.sort().values, expected.sort().values)
    assert torch.all(acc[idx][:-1] >= acc[idx][1:])  # the master's values form a monotone curve


def _ref_encode(ae: LGCAutoencoder, x: torch.Tensor) -> torch.Tensor:
    """The encoder by its architecture (module doc), float64, on the
    autoencoder's weights: zero-pad to 4 L, Conv1d(1,c,5,pad 2), LeakyReLU,
    Conv1d(c,c,4,stride 2,pad 1), LeakyReLU, Conv1d(c,1,4,stride 2,pad 1)."""
    f = torch.nn.functional
    c1, a1, c2, a2, c3 = ae.encoder
    h = f.pad(x, (0, ae.padded - ae.k)).unsqueeze(1)
    h = f.leaky_relu(f.conv1d(h, c1.weight.double(), c1.bias.double(), padding=2), a1.negative_slope)
    h = f.leaky_relu(f.conv1d(h, c2.weight.double(), c2.bias.double(), stride=2, padding=1), a2.negative_slope)
    return f.conv1d(h, c3.weight.double(), c3.bias.double(), stride=2, padding=1).squeeze(1)


def _ref_decode(ae: LGCAutoencoder, z: torch.Tensor, j: int) -> torch.Tensor:
    """Decoder ``j`` by its architecture, float64: the encoder mirrored with
    transposed convolutions, cropped back to k."""
    f = torch.nn.functional
    t1, a1, t2, a2, c = ae.decoders[j]
    h = z.unsqueeze(1)
    h = f.leaky_relu(f.conv_transpose1d(h, t1.weight.double(), t1.bias.double(), stride=2, padding=1),
                     a1.negative_slope)
    h = f.leaky_relu(f.conv_transpose1d(h, t2.weight.double(), t2.bias.double(), stride=2, padding=1),
                     a2.negative_slope)
    return f.conv1d(h, c.weight.double(), c.bias.double(), padding=2).squeeze(1)[:, : ae.k]


@pytest.mark.parametrize("decoders", [N, 1])
def test_losses_are_the_papers_reconstruction_and_similarity_terms(decoders: int) -> None:
    """On 4 nodes' values (k = 106, latent 27): the reconstruction term is
    mean_j MSE(dec_j(enc(x_j)), x_j) (PS: decoder j for node j; ring: the one
    decoder for every node), the similarity term the paper's pairwise
    sum_{i<j} |z_i - z_j|^2 scaled to mean_j MSE(z_j, mean_i z_i), that is
    divided by N^2 L; train_step's first loss is 0.5 of each (w_rec = w_sim =
    0.5). References in float64 from the architecture and the weights."""
    ae = LGCAutoencoder(106, decoders, 4, seed=3)
    x = torch.randn(N, 106, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    x = x + torch.linspace(2.0, -2.0, 106, dtype=torch.float64)  # a shared, decreasing curve
    x = x.float().double()  # the values the float32 autoencoder sees
    with torch.no_grad():
        z = _ref_encode(ae, x)
        recon = torch.cat([_ref_decode(ae, z[j : j + 1], j if decoders > 1 else 0) for j in range(N)])
        want_rec = float(((recon - x) ** 2).mean())
        pairs = sum(float(((z[i] - z[j]) ** 2).sum()) for i in range(N) for j in range(i + 1, N))
        want_sim = pairs / (N * N * ae.latent)
        rec, sim = ae.losses(x)
    assert float(rec) == pytest.approx(want_rec, rel=1e-5)
    assert float(sim) == pytest.approx(want_sim, rel=1e-5)
    first = train_step(ae, torch.optim.SGD(ae.parameters(), lr=0.0), x.float())
    assert float(first) == pytest.approx(0.5 * want_rec + 0.5 * want_sim, rel=1e-5)
