"""Every test under tests/gpu needs a CUDA device: each one is marked ``gpu`` here, and
skipped, with the reason, where none is visible (CI, laptops), so that the whole suite is
still collected everywhere."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

_HERE = Path(__file__).parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Runs before pytest's own -m selection (conftest hooks first), so -m gpu sees the mark.
    skip = None if torch.cuda.is_available() else pytest.mark.skip(
        reason="no CUDA device visible")
    for item in items:
        if _HERE in item.path.parents:
            item.add_marker(pytest.mark.gpu)
            if skip is not None:
                item.add_marker(skip)
