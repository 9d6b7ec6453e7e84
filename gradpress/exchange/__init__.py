"""Exchange: "average these keyed tensors, compressed".

The strategies (allreduce, allgather, ring, ps, hierarchical, cyclic, union;
multi-round protocols inside allreduce), the one home of error feedback (:mod:`.feedback`), the cost model
and planner (each strategy predicts its own cost), the NaN/Inf protocol, the
stats, and the engine that owns them (:class:`Synchronizer`). Knows
compressors and transports; knows nothing of DDP or optimizers.
"""

from gradpress.exchange.base import ExchangeResult, Strategy, available, get_strategy, register_strategy
from gradpress.exchange.engine import Synchronizer
from gradpress.exchange.nonfinite import NONFINITE_MODES
from gradpress.exchange.stats import STATS_KEYS

__all__ = [
    "ExchangeResult", "NONFINITE_MODES", "STATS_KEYS", "Strategy", "Synchronizer", "available", "get_strategy",
    "register_strategy",
]
