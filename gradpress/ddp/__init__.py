"""DDP integration: ``gradpress.ddp.register(ddp_model, "topk:ratio=0.01")``,
or PyTorch's hook/state pair ``state, hook = gradpress.ddp.make_hook(spec)``
for ``ddp_model.register_comm_hook(state, hook)`` (and so for Lightning's
``DDPStrategy(ddp_comm_hook=hook, ddp_comm_state=state)``).

A thin layer over the exchange engine (:mod:`gradpress.exchange`): the hook
turns DDP's gradient buckets into keyed views and hands them to the engine;
``register`` builds it, checks that every rank agrees, and registers it.
Never imports :mod:`gradpress.algorithms` (its sibling).
"""

from gradpress.ddp.hook import GradpressHook, gradpress_hook
from gradpress.ddp.register import make_hook, register
from gradpress.exchange.nonfinite import NONFINITE_MODES
from gradpress.exchange.stats import STATS_KEYS

__all__ = ["register", "make_hook", "GradpressHook", "gradpress_hook", "STATS_KEYS", "NONFINITE_MODES"]
