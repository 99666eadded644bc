"""A failing worker's error record (what the launcher's failure summary and torch's agent
read) is written whole or not at all."""

from __future__ import annotations

import json

import pytest

from shoal.launch import worker


def test_an_error_record_is_written_whole_or_not_at_all(tmp_path, monkeypatch):
    path = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))

    def stopped(*_args, **_kwargs):  # the process ends mid-write (the agent's SIGTERM)
        raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr(json, "dump", stopped)
        with pytest.raises(KeyboardInterrupt):
            worker._record(ValueError("boom"))
    assert not path.exists()  # torch's agent reads no file rather than an empty one
    worker._record(ValueError("boom"))
    record = json.loads(path.read_text())
    assert record["message"]["message"] == "ValueError: boom"
    assert "ValueError: boom" in record["message"]["extraInfo"]["py_callstack"]
