"""Plot of the compressor benchmark: encode throughput against compression
ratio, log axes, one labelled point per method (largest size benchmarked),
with the copy roofline and its 25% line for reference. Zero-copy rows (the
identity, whose encode is a view) are left out."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

__all__ = ["plot_throughput"]


def plot_throughput(rows: list[dict[str, Any]], path: str | Path, title: str = "") -> Path | None:
    """Write the plot to ``path``; returns it, or None when no row has a
    positive throughput and ratio."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not rows:
        return None
    size = max(r["numel"] for r in rows)
    # zero-copy rows (``none`` returns a view: nothing allocated, nothing moved)
    # would only stretch the axis
    pts = [r for r in rows if r["numel"] == size and _finite_positive(r["encode_gbps"])
           and _finite_positive(r["ratio"]) and r.get("peak_temp_bytes") != 0]
    if not pts:
        return None
    fig, ax = plt.subplots(figsize=(10, 6.5), dpi=110)
    cmap = plt.get_cmap("tab20")
    xs = [r["ratio"] for r in pts]
    ys = [r["encode_gbps"] for r in pts]
    ax.set_xscale("log")
    ax.set_yscale("log")
    roof = pts[0]["roofline_gbps"]
    ax.set_xlim(min(xs) / 1.6, max(xs) * 2.5)
    ax.set_ylim(min(ys + [0.25 * roof]) / 2.0, max(ys + [roof]) * 2.0)
    fig.canvas.draw()
    placed: list[tuple[float, float, float, float]] = []  # display-pixel boxes: markers, then labels
    for xy in zip(xs, ys):
        px, py = ax.transData.transform(xy)
        placed.append((px - 5, py - 5, px + 5, py + 5))
    for i, r in enumerate(pts):
        ref = r["kind"] == "reference"
        ax.scatter(r["ratio"], r["encode_gbps"], s=45, marker="x" if ref else "o",
                   color="0.4" if ref else cmap(i % 20), zorder=3)
        label = r["compressor"] if ref else r["name"]
        _annotate(ax, (r["ratio"], r["encode_gbps"]), label, placed, "0.35" if ref else "black")
    ax.axhline(roof, color="tab:red", lw=1, ls="--", label=f"copy roofline {roof:.2f} GB/s (read+write)")
    ax.axhline(0.25 * roof, color="tab:red", lw=0.8, ls=":", label="25% of roofline")
    ax.set_xlabel("compression ratio (fp32 bytes / wire bytes)")
    ax.set_ylabel("encode throughput (GB/s of fp32 input)")
    ax.set_title(title or f"compressor encode throughput, {size:,} elements")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def _annotate(ax, xy, label, placed, color) -> None:
    """Label a point at the first of a few offsets whose text box (estimated in
    display pixels) overlaps no marker or label placed before (the first
    offset when every one does); greedy, good enough for twenty points."""
    px, py = ax.transData.transform(xy)
    w, h = 6.2 * len(label), 11.0
    offsets = [(6, 4), (6, -14), (-6 - w, 4), (-6 - w, -14), (6, 16), (6, -26), (-6 - w, 16), (-6 - w, -26),
               (6, 28), (6, -38)]
    best = offsets[0]
    for dx, dy in offsets:
        box = (px + dx, py + dy, px + dx + w, py + dy + h)
        if not any(box[0] < b[2] and b[0] < box[2] and box[1] < b[3] and b[1] < box[3] for b in placed):
            best = (dx, dy)
            break
    dx, dy = best
    placed.append((px + dx, py + dy, px + dx + w, py + dy + h))
    ax.annotate(label, xy, textcoords="offset points", xytext=(dx * 72 / ax.figure.dpi, dy * 72 / ax.figure.dpi),
                fontsize=8, color=color, ha="left", va="bottom")


def _finite_positive(v) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v) and v > 0
