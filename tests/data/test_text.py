"""The standard-library text corpus: deterministic, shifted targets, splits that never touch."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import pytest
import torch

from shoal.data.text import _source_files, build_data, load_stdlib_corpus


def test_corpus_is_deterministic_and_capped():
    first, second = load_stdlib_corpus(100_000), load_stdlib_corpus(100_000)
    assert first.tokens.dtype == torch.uint8 and len(first.tokens) == 100_000
    assert torch.equal(first.tokens, second.tokens) and first.files == second.files > 1
    # The cap cuts the same stream: a smaller corpus is a prefix of a larger one.
    assert torch.equal(load_stdlib_corpus(30_000).tokens, first.tokens[:30_000])
    assert "100,000 bytes" in first.describe()


def test_corpus_leaves_out_tests_and_installed_packages():
    root = Path(sysconfig.get_paths()["stdlib"])
    names = [path.relative_to(root).as_posix() for path in _source_files(root)]
    assert names == sorted(names) and "os.py" in names and "json/decoder.py" in names
    assert not any(part in ("test", "tests", "idle_test", "site-packages")
                   for name in names for part in name.split("/")[:-1])


def test_windows_are_inputs_shifted_by_one_byte():
    train, val = build_data(seq_len=16, max_bytes=50_000)
    for dataset in (train, val):
        inputs, targets = dataset[3]
        assert inputs.dtype == targets.dtype == torch.long and inputs.shape == (16,)
        assert torch.equal(inputs[1:], targets[:-1])
        whole = dataset.tokens[3 * 16: 3 * 16 + 17].long()
        assert torch.equal(inputs, whole[:-1]) and torch.equal(targets, whole[1:])
    with pytest.raises(IndexError):
        train[len(train)]


def test_train_and_validation_do_not_share_a_byte():
    corpus = load_stdlib_corpus(50_000).tokens
    train, val = build_data(seq_len=16, max_bytes=50_000, val_fraction=0.1, stride=5)
    assert val.start == len(train.tokens) == 45_000
    assert torch.equal(torch.cat([train.tokens, val.tokens]), corpus)  # views, in order
    last_train = (len(train) - 1) * 5 + 16  # last byte a train target reads (exclusive)
    assert last_train < val.start
    # Overlapping windows with a stride, none running past its split.
    assert len(train) == (45_000 - 17) // 5 + 1 and len(val) == (5_000 - 17) // 5 + 1
    assert train.tokens.untyped_storage().data_ptr() == val.tokens.untyped_storage().data_ptr()


def test_too_small_a_corpus_is_a_clear_error():
    with pytest.raises(ValueError, match="too small for one window"):
        build_data(seq_len=128, max_bytes=1_000)
    with pytest.raises(ValueError, match="val_fraction"):
        build_data(val_fraction=1.0)


def test_missing_standard_library_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setattr("sysconfig.get_paths", lambda: {"stdlib": str(tmp_path / "none")})
    with pytest.raises(FileNotFoundError, match="standard library"):
        load_stdlib_corpus()
