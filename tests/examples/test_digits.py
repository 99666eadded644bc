"""The digits example reads scikit-learn's file itself; it must give what scikit-learn gives."""

import numpy as np
from sklearn.datasets import load_digits as sklearn_digits

from shoal.examples.digits import build_data, load_digits


def test_digits_are_scikit_learns_digits():
    pixels, labels = load_digits()
    reference = sklearn_digits()
    assert pixels.dtype == reference.data.dtype and labels.dtype == reference.target.dtype
    assert np.array_equal(pixels, reference.data)
    assert np.array_equal(labels, reference.target)
    train, val = build_data()
    assert len(train) + len(val) == 1797
    assert float(train.tensors[0].max()) == 1.0
