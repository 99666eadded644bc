"""shoal.ft.step: a loss sum in three float32 parts, which a float32 collective sums
exactly."""

import math
import random

import numpy as np
import pytest

from shoal.ft.step import loss_parts


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
