"""Transport: bytes only. Fused allreduce, variable-size allgather,
point-to-point exchange, wire packing, gradpress's own groups with timeouts.

Knows tensors and process groups; knows nothing of compressors' semantics,
error feedback, DDP or optimizers.
"""

from gradpress.transport.collectives import allgather_bytes, fused_allreduce
from gradpress.transport.groups import own_group, timeout_of
from gradpress.transport.p2p import exchange_bytes, global_rank

__all__ = ["allgather_bytes", "exchange_bytes", "fused_allreduce", "global_rank", "own_group", "timeout_of"]
