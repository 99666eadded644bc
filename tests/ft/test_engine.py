"""Replica's collectives across groups never raise where they start: a failure marks the
step as errored, and the one callback (``then``) runs inside the future, on the values the
collective gave or on the failed value (zeros for a gather). The failures are injected: a
collective whose future fails, a process group that is gone, a step already errored."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("torchft")

from shoal.ft.engine import Replica, _UniqueQuorumIds  # noqa: E402 - after the skip


def _future(value=None, error: Exception | None = None) -> torch.futures.Future:
    future: torch.futures.Future = torch.futures.Future()
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(value)
    return future


class _Work:
    def __init__(self, future: torch.futures.Future):
        self.future = future

    def get_future(self) -> torch.futures.Future:
        return self.future


class _ProcessGroup:
    """Sums by doubling (two groups holding the same tensor), or fails as told. Plays
    torchft's wrapper (``parent``, ``abort``) and the process group it wraps."""

    def __init__(self, fails: Exception | None = None, gone: bool = False):
        self.fails, self.gone, self.aborted, self.launched = fails, gone, False, 0

    @property
    def parent(self) -> _ProcessGroup:
        return self

    def allreduce(self, tensors, options):
        self.launched += 1
        if self.gone:
            raise RuntimeError("the process group is closed")
        if self.fails is not None:
            return _Work(_future(error=self.fails))
        tensors[0].mul_(2)
        return _Work(_future(tensors))

    def size(self) -> int:
        return 2

    def allgather_into_tensor_coalesced(self, outputs, inputs, options):
        self.launched += 1
        return _Work(_future(error=self.fails))

    def abort(self, errored: bool) -> None:
        self.aborted = True


class _Manager:
    def __init__(self, pg: _ProcessGroup, errored: Exception | None = None):
        self._pg, self.error, self.reported = pg, errored, []

    def errored(self):
        return self.error

    def is_participating(self) -> bool:
        return True

    def report_error(self, error: Exception) -> None:
        self.reported.append(error)
        self.error = error


def _replica(pg: _ProcessGroup, errored: Exception | None = None) -> Replica:
    replica = Replica.__new__(Replica)  # its manager only: no lighthouse, no torchft server
    replica._manager = _Manager(pg, errored)
    replica._sum_options = replica._gather_options = None
    return replica


def _seen() -> tuple[list[torch.Tensor], object]:
    seen: list[torch.Tensor] = []

    def then(tensor: torch.Tensor) -> torch.Tensor:
        seen.append(tensor.clone())
        return tensor + 1
    return seen, then


def test_a_sum_that_goes_through_passes_the_sum_to_then():
    seen, then = _seen()
    replica = _replica(_ProcessGroup())
    value = replica.start_sum(torch.ones(3), then=then).wait()
    assert torch.equal(seen[0], torch.full((3,), 2.0)) and torch.equal(value, seen[0] + 1)
    assert replica._manager.reported == []


@pytest.mark.parametrize("how", ["collective fails", "process group gone", "step errored"])
def test_a_failure_marks_the_step_and_then_gets_the_failed_value(how):
    lost = RuntimeError("a replica group is gone")
    pg = _ProcessGroup(fails=lost if how == "collective fails" else None,
                       gone=how == "process group gone")
    replica = _replica(pg, errored=lost if how == "step errored" else None)
    seen, then = _seen()
    value = replica.start_sum(torch.ones(3), then=then).wait()  # no raise
    assert torch.equal(value, seen[0] + 1)
    assert replica._manager.errored() is not None  # the step does not commit
    if how == "step errored":  # skipped: not launched, and the process group closed
        assert pg.launched == 0 and pg.aborted
    else:
        assert replica._manager.reported and pg.launched == 1


@pytest.mark.parametrize("how", ["collective fails", "step errored"])
def test_a_failed_gathers_rows_are_zeros(how):
    lost = RuntimeError("a replica group is gone")
    pg = _ProcessGroup(fails=lost)
    replica = _replica(pg, errored=lost if how == "step errored" else None)
    seen, then = _seen()
    replica.start_gather(torch.ones(4), then=then).wait()
    assert torch.equal(seen[0], torch.zeros(1, 4))
    assert pg.launched == (1 if how == "collective fails" else 0)


def test_an_error_in_then_comes_out_of_the_future_not_where_the_sum_started():
    def then(tensor: torch.Tensor) -> torch.Tensor:
        raise ValueError("the callback's own error")
    for pg, errored in ((_ProcessGroup(), None),
                        (_ProcessGroup(), RuntimeError("a replica group is gone"))):
        future = _replica(pg, errored).start_sum(torch.ones(2), then=then)  # no raise here
        with pytest.raises(RuntimeError, match="the callback's own error"):
            future.wait()


class _Lighthouse:
    """What a manager's client says of each quorum: the lighthouse's id, the members, the
    step."""

    def __init__(self, answers: list[tuple[int, list[str], int]]):
        self.answers = answers

    def _quorum(self, **_):
        quorum_id, members, step = self.answers.pop(0)
        return SimpleNamespace(quorum_id=quorum_id, replica_ids=members, max_step=step)


def test_a_lighthouse_started_again_gives_quorum_ids_never_seen_before():
    """A lighthouse started again counts its quorums' ids from 1 again. The ids a manager
    sees stay the same while the lighthouse's id and the members do (its process group is
    kept), are new after a new lighthouse's first quorum, also with the same members (a
    process group under a store prefix used before could read an address of the past), and
    are the same in a survivor and a replacement that meet there."""
    group_0, group_1, replacement = "shoal_group_0:a", "shoal_group_1:b", "shoal_group_1:c"
    same, joined = [group_0, group_1], [group_0, replacement]
    survivor = _UniqueQuorumIds(_Lighthouse([
        (1, same, 0), (1, same, 5), (2, same, 7),  # a failed commit: a new id
        (1, same, 9),  # the lighthouse started again: the same members
        (2, joined, 12)]))  # a group killed: its replacement joins
    ids = [survivor._quorum().quorum_id for _ in range(5)]
    assert ids[0] == ids[1] and len(set(ids)) == 4, ids
    newcomer = _UniqueQuorumIds(_Lighthouse([(2, joined, 12)]))
    assert newcomer._quorum().quorum_id == ids[4]
