"""The failure summary's reading of the ranks' error files."""

from __future__ import annotations

import json

import pytest
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from shoal.launch.summary import collect_failures


def _error_file(directory, local_rank: int, text: str) -> str:
    folder = directory / "attempt_0" / str(local_rank)
    folder.mkdir(parents=True)
    (folder / "error.json").write_text(text)
    return str(folder / "error.json")


@pytest.mark.timeout(30)
def test_an_error_file_cut_short_is_passed_over(tmp_path):
    """A rank stopped while it wrote its error file leaves it empty: the summary tells the
    other ranks' failures instead of failing itself."""
    message = {"message": {"message": "ValueError: injected", "extraInfo": {
        "py_callstack": "Traceback ...", "timestamp": "1"}}}
    first = ProcessFailure(local_rank=0, pid=1, exitcode=1,
                           error_file=_error_file(tmp_path, 0, json.dumps(message)))
    _error_file(tmp_path, 1, "")
    _error_file(tmp_path, 2, '{"message": {"mess')
    failures = collect_failures(ChildFailedError("job", {0: first}), str(tmp_path))
    assert sorted(failures) == [0]
