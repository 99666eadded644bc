"""shoal.ft.step: a loss sum in three float32 parts, which a float32 collective sums
exactly; a hand-over's copy of a state, which later steps do not change."""

import copy
import math
import random
from collections import OrderedDict, namedtuple

import numpy as np
import pytest
import torch

from shoal.ft.step import copied, loss_parts


@pytest.mark.parametrize("value", [0.0, 2.302585092994046, 1234.5678901234567, 1e-20,
                                   7.0e30, -3.25])
def test_the_parts_are_float32_and_add_up_to_the_value(value):
    parts = loss_parts(value)
    assert all(float(np.float32(p)) == p for p in parts)
    assert math.fsum(parts) == value


def test_each_part_is_rounded_as_numpys_cast_rounds_it():
    r = random.Random(0)
    values = [r.lognormvariate(0, 30) for _ in range(5000)]
    values += [math.inf, -math.inf, 3.4028235e38, 3.4028236e38, -1e300, 1e-46]
    with np.errstate(over="ignore"):
        for value in values:
            assert loss_parts(value)[0] == float(np.float32(value)), value
    assert math.isnan(loss_parts(math.nan)[0])


def test_a_copied_state_equals_deepcopys_and_shares_nothing_that_changes():
    Betas = namedtuple("Betas", "first second")
    weight = torch.arange(6.0).view(2, 3)
    state = {"model": {"w": weight, "b": torch.zeros(3)}, "step": 4, "lr": 0.1,
             "groups": [{"params": ["w", "b"], "betas": (0.9, 0.999)}],
             "named": Betas(torch.ones(2), 2), "ordered": OrderedDict(a=[1, 2]), "none": None}
    copy_ = copied(state)
    assert repr(copy_) == repr(copy.deepcopy(state))
    assert type(copy_["named"]) is Betas and type(copy_["ordered"]) is OrderedDict
    weight.add_(1)  # a later step, in place
    state["groups"][0]["params"].append("c")
    state["named"].first.zero_()
    state["ordered"]["a"].append(3)
    assert torch.equal(copy_["model"]["w"], torch.arange(6.0).view(2, 3))
    assert copy_["groups"][0]["params"] == ["w", "b"]
    assert torch.equal(copy_["named"].first, torch.ones(2))
    assert copy_["ordered"]["a"] == [1, 2]
