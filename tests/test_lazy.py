"""A package's names imported on first use: listed once, before and after their import."""

import shoal.checkpoint


def test_a_lazy_name_is_listed_once_before_and_after_its_import():
    assert dir(shoal.checkpoint).count("CheckpointStore") == 1
    assert shoal.checkpoint.CheckpointStore.__name__ == "CheckpointStore"
    assert dir(shoal.checkpoint).count("CheckpointStore") == 1
