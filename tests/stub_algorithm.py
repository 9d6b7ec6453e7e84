"""What ``gradpress.train`` needs of an algorithm besides ``step`` and
``describe``, for the tests' stand-ins (registered through
``gradpress.train.algorithm._registry``): local steps only (world size 1),
each step counted as 10 bytes sent of 40 dense ones, stats in the hook's
vocabulary, and a step counter that must survive a resume."""

from __future__ import annotations

from typing import Any

import torch


class CountingAlgorithm:
    """Base of a stand-in: ``self.model`` and ``self.counter`` (the steps taken) set by the subclass."""

    model: torch.nn.Module
    counter = 0

    def eval_model(self) -> torch.nn.Module:
        return self.model

    def extra_stats(self) -> dict[str, Any]:
        """Stats a subclass adds to the counts."""
        return {}

    @property
    def stats(self) -> dict[str, Any]:
        from gradpress.ddp import STATS_KEYS

        out = dict.fromkeys(STATS_KEYS, 0)
        out.update(steps=self.counter, bytes_sent=10 * self.counter, dense_bytes=40 * self.counter,
                   **self.extra_stats())
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"counter": torch.tensor(self.counter)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.counter = int(state["counter"])

    def close(self) -> None:
        pass
