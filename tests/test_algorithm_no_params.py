"""An algorithm on a model with no trainable parameter is refused at construction, naming the algorithm and
what is allowed. Before, each failed its own way, or not at all: ``localsgd``/``postlocalsgd`` on 2 ranks crashed
at the first synchronization ("stack expects a non-empty TensorList"), ``comprex`` with "Tensor list must have at
least one tensor", ``diloco`` in torch's optimizer, ``lgc`` with a message about dtypes, ``choco``, ``dpsgd`` and
``sgp`` ran doing nothing."""
from __future__ import annotations

import pytest
import torch
from distributed import one_rank_module

import gradpress.algorithms as algorithms

one_rank = one_rank_module  # the module-scoped one-process group (tests/distributed.py)


@pytest.mark.parametrize("name", algorithms.names())
def test_a_model_without_trainable_parameters_is_refused_naming_the_algorithm(one_rank, name: str) -> None:  # noqa: ANN001
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    for p in model.parameters():
        p.requires_grad_(False)
    optimizer = torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))], lr=0.1)  # Adam: every algorithm accepts it
    with pytest.raises(ValueError) as exc:
        algorithms.create(name, model, optimizer)
    # one error on every rank, naming the stage: construction (it said "registration", the DDP hook's word)
    assert str(exc.value).startswith(f"algorithm {name!r} construction failed: rank 0: "), str(exc.value)
    assert (f"algorithm {name!r}: the model has no trainable parameter (none with requires_grad=True): nothing to "
            "train or synchronize; allowed: a model with at least one") in str(exc.value)
