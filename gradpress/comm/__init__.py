"""Strategies: how encoded packets travel between ranks and are aggregated.

Every strategy runs synchronously on the hook's communication thread, which
processes buckets in the order DDP hands them over; so all ranks issue their
collectives in the same order, whatever the number of buckets in flight.
"""

from gradpress.comm.base import Strategy, available, get_strategy, register_strategy

__all__ = ["Strategy", "available", "get_strategy", "register_strategy"]
