"""The planner's prediction for :class:`~gradpress.exchange.strategies.hierarchical.Hierarchical`.

Bytes per link, for one tensor of ``d`` elements of ``e`` bytes whose
packet is ``c = wire(d)`` bytes, on ``H`` hosts of ``L`` workers, counted
on the leader's links (the busiest: every byte of the host's sum arrives
there and every byte of the average leaves from there; a pipelined chain
or tree reaches these, and no algorithm does with less):

* the dense reduce onto the leader, over the host's link: ``e d`` (0 when ``L = 1``);
* the leaders' exchange, over the host's network link: a ring allreduce
  of summable packets ``2 (H - 1) / H c``, else an allgather ``(H - 1) c``
  (what arrives from the other leaders);
* the broadcast back, over the host's link: ``e d`` (0 when ``L = 1``).

Seconds from the fits (:mod:`gradpress.exchange.costs`), each fit read at
the payload that moves those bytes per link: an allreduce of ``x`` among
``k`` ranks moves ``2 (k - 1) / k x`` over each rank's link, an allgather
of ``x`` per rank ``(k - 1) x``. The host's link is the injected
``intra_allreduce`` fit (an allreduce among the ``L`` workers of a host);
the probe measures the group as one level, so without it the group's
``allreduce`` fit of ``N`` ranks stands for the host's link too (as slow as
the network: hierarchical then never predicts a gain). The leaders'
exchange is the group's fits of ``N`` ranks read at ``H`` leaders' bytes
(the probe has no fit of the leaders' group); one latency per collective
either way. Pipelined (the default ``chunk``), the codec overlaps the wire:
the larger of the two counts; the host's reduce and broadcast are added
(not overlapped: an upper bound when pipelined).
"""

from __future__ import annotations

from dataclasses import dataclass

from gradpress.exchange.costs import CostModel

__all__ = ["LinkBytes", "link_bytes", "predict_seconds"]


@dataclass(frozen=True)
class LinkBytes:
    """Bytes over a leader's links for one tensor (see the module doc)."""

    reduce: float  # over the host's link, into the leader
    outer: float  # over the host's network link, from the other leaders
    broadcast: float  # over the host's link, out of the leader


def link_bytes(numel: int, elem_size: int, per_host: int, hosts: int, wire_bytes: float, summable: bool) -> LinkBytes:
    """The bytes per link of the module doc. ``wire_bytes``: the packet of
    ``numel`` elements; ``summable``: the leaders allreduce (else allgather)."""
    for name, value in (("numel", numel), ("elem_size", elem_size), ("per_host", per_host), ("hosts", hosts)):
        if not isinstance(value, int) or isinstance(value, bool) or value < (0 if name == "numel" else 1):
            raise ValueError(f"link_bytes: {name}={value!r}; allowed: an integer >= {0 if name == 'numel' else 1}")
    if not wire_bytes >= 0:
        raise ValueError(f"link_bytes: wire_bytes={wire_bytes!r}; allowed: a number >= 0")
    dense = float(numel * elem_size) if per_host > 1 else 0.0
    h = hosts
    outer = 2.0 * (h - 1) / h * wire_bytes if summable else (h - 1) * float(wire_bytes)
    return LinkBytes(dense, outer, dense)


def _allreduce_payload(link: float, ranks: int) -> float:
    """The payload of an allreduce among ``ranks`` that moves ``link`` bytes over each rank's link."""
    return link * ranks / (2.0 * (ranks - 1)) if ranks > 1 else 0.0


def predict_seconds(costs: CostModel, numel: int, world_size: int, summable: bool, per_host: int,
                    elem_size: int = 4) -> float:
    """Predicted seconds of one tensor's hierarchical exchange on ``world_size``
    ranks in hosts of ``per_host`` (a divisor; else one worker per host is assumed)."""
    n = max(1, world_size)
    per = per_host if per_host >= 1 and n % per_host == 0 else 1
    h = n // per
    d = float(numel)
    dense = float(numel * elem_size)

    def host_link(link: float) -> float:
        """A collective that moves ``link`` bytes over each link inside a host."""
        if costs.intra_allreduce is not None:
            return costs.intra_allreduce(_allreduce_payload(link, per))
        return costs.allreduce(_allreduce_payload(link, n))

    if h <= 1:  # one host: one dense allreduce among its ranks (nothing compressed)
        return host_link(2.0 * (per - 1) / per * dense) if per > 1 else 0.0
    moved = link_bytes(numel, elem_size, per, h, costs.wire(d), summable)
    inner = host_link(moved.reduce) + host_link(moved.broadcast) if per > 1 else 0.0
    if summable:
        outer = max(costs.allreduce(_allreduce_payload(moved.outer, n)), costs.encode(d) + costs.decode(d))
    else:
        outer = max(costs.allgather(moved.outer / (n - 1)), costs.encode(d) + h * costs.decode(d))
    return inner + outer
