"""The one module that meets torchft: its lighthouse, its manager and its reconfigurable
process group, behind shoal's own small types. Nothing else in shoal imports torchft.

Used pieces (torchft 0.2.0): ``LighthouseServer``; ``Manager`` with a synchronous quorum
at the start of each step (a replacement heals before its forward pass, so it takes part
in the very step it joins at) and the HTTP transport for healing; ``ProcessGroupGloo``
across groups. Not used: torchft's ``DistributedDataParallel`` wrapper, which can crash the
survivors of a killed gloo peer (``assert fut._fut``): gradients are summed here on the
quorum's process group, in shoal's own DDP hook (``shoal.ft.across``, whose sums never
raise inside backward) or after backward.
"""

from __future__ import annotations

import hashlib
import logging
import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from shoal.errors import UsageError
from shoal.extras import install_line
from shoal.ft.config import FaultToleranceConfig, ReplicaPlace

if TYPE_CHECKING:
    import torch

After = Callable[["torch.Tensor"], "torch.Tensor"]
"""What a collective's result goes through before its future holds it."""

_MISSING = f"live recovery needs torchft: {install_line('ft')}"


def _torchft() -> Any:
    try:
        import torchft
    except ImportError:
        raise UsageError(_MISSING) from None
    # A failed step is said by shoal in one line; torchft would add a traceback per failure
    # (and a warning per quorum about NCCL's flight recorder, which gloo does not have).
    logging.getLogger("torchft").setLevel(logging.CRITICAL)
    # Healed tensors are read from the transfer's buffer and copied into the model at once.
    warnings.filterwarnings("ignore", message="The given buffer is not writable")
    return torchft


def check_available() -> None:
    """Refuse at the edge, in one line, when torchft is not installed."""
    if _find_torchft() is None:
        raise UsageError(_MISSING)


def _find_torchft() -> Any:
    """torchft's package spec, without running the package (which imports torch)."""
    import importlib.util

    try:
        return importlib.util.find_spec("torchft")
    except ValueError:  # in sys.modules as None: taken away on purpose
        return None


_QUORUM_TICK_MS = 50
"""How often the lighthouse looks again at a quorum that waits. It forms one at once when a
group asks; the tick only notices that a dead group's beats ran out (at most this long
after). Each tick wakes the lighthouse's threads, beside busy workers: 50 ms takes 20
looks a second from their cores instead of 50."""
_BEATS_PER_TIMEOUT = 3
"""A manager beats this many times in ``heartbeat_timeout_ms``: a beat late by up to two
thirds of the timeout does not drop a group. Each beat is a call to the lighthouse that
wakes threads in both processes; three a timeout instead of five cut what the lighthouse
and the managers' threads take from the workers' cores by a third to a half
(``benchmarks/live_step.py --cpu``)."""


def serve_lighthouse(bind: str, min_replicas: int, config: FaultToleranceConfig) -> Any:
    """Start torchft's lighthouse in this process; returns the server (``shutdown()``).

    Only torchft's compiled extension is loaded, not its package (which imports torch): the
    daemon is up in well under a second, also when the launcher starts it again."""
    import importlib.util
    from pathlib import Path

    found = _find_torchft()
    if found is None or not found.submodule_search_locations:
        raise UsageError(_MISSING)
    folder = Path(next(iter(found.submodule_search_locations)))
    library = next(folder.glob("_torchft*.so"), None)
    if library is None:
        raise UsageError(f"torchft in {folder} has no compiled extension: {_MISSING}")
    spec = importlib.util.spec_from_file_location("torchft._torchft", library)
    assert spec is not None and spec.loader is not None  # an extension module's file
    extension = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(extension)
    return extension.LighthouseServer(bind=bind, min_replicas=min_replicas,
                                      join_timeout_ms=config.join_timeout_ms,
                                      quorum_tick_ms=_QUORUM_TICK_MS,
                                      heartbeat_timeout_ms=config.heartbeat_timeout_ms)


@dataclass(frozen=True)
class Quorum:
    """What one step's quorum said to this group."""

    participants: int
    """Replica groups taking part in this step."""
    healed: bool
    """This group just loaded a live group's state."""


def _heal_transport(host: str, timeout: timedelta) -> Any:
    """torchft's HTTP transport for heals, at ``host``: torchft's own names the server by
    this machine's hostname, which the other machines may not resolve."""
    from torchft.checkpointing.http_transport import HTTPTransport

    class _Transport(HTTPTransport):
        def __init__(self, *args: Any, **kwargs: Any):
            super().__init__(*args, **kwargs)
            # Not an access-log line in the job's output per heal request.
            self._server.RequestHandlerClass.log_message = lambda *_: None

        def address(self) -> str:
            port = self._server.socket.getsockname()[1]
            name = f"[{host}]" if ":" in host else host
            return f"http://{name}:{port}/checkpoint/"

    return _Transport(timeout=timeout, num_chunks=0)


_RETRY_EVERY_S = 0.25
"""How often a manager asks a lighthouse that did not answer again (see ``Replica``)."""

# What a one-process group's local commit vote reads and sets in torchft's Manager (its
# should_commit does the same, then waits for the group's other ranks).
_COMMIT_FIELDS = ("_recovery_event", "_pg", "_healing", "_apply_pending_state_dict",
                  "_min_replica_size", "_errored", "_checkpoint_transport", "_step",
                  "_batches_committed", "_commit_failures")


def _accelerator() -> bool:
    import torch

    return torch.accelerator.is_available()


class Replica:
    """This worker's membership in the quorum: one torchft Manager and its process group
    across groups (rank i of each group meets rank i of the others)."""

    def __init__(self, place: ReplicaPlace, group_rank: int, group_size: int,
                 state: Callable[[], dict], load: Callable[[dict], None]):
        torchft = _torchft()
        from torchft.manager import Manager

        c = place.config
        step = timedelta(seconds=c.step_timeout_s)
        self._healed = False
        self._participants = 0  # groups in the last quorum
        self._leads = False  # this group comes first in it
        self._load = load
        exact = c.policy == "exact"
        quorum_wait = c.replacement_timeout_s if exact else c.step_timeout_s
        self._manager = Manager(
            pg=torchft.ProcessGroupGloo(timeout=step),
            checkpoint_transport=_heal_transport(place.host, step),
            load_state_dict=self._loaded, state_dict=state,
            # exact: a step commits only with every group in it.
            min_replica_size=place.groups if exact else 1,
            use_async_quorum=False, timeout=step,
            quorum_timeout=timedelta(seconds=quorum_wait),
            connect_timeout=step, rank=group_rank, world_size=group_size,
            lighthouse_addr=place.lighthouse, replica_id=f"shoal_group_{place.group}",
            hostname=place.host, init_sync=True,
            heartbeat_interval=timedelta(
                milliseconds=c.heartbeat_timeout_ms / _BEATS_PER_TIMEOUT),
            # The ManagerServer asks the lighthouse again when a request fails, after the
            # quorum's timeout divided by retries + 1 (at least 0.1 s): with 20 retries,
            # 5.7 s under 'exact'. A lighthouse the launcher starts again is back within a
            # second: asked again every quarter of a second, it is met at once.
            quorum_retries=max(20, math.ceil(quorum_wait / _RETRY_EVERY_S)))
        self._manager._client = _UniqueQuorumIds(self._manager._client)
        # A process at the vote waits for the others of its group, which may each still be
        # in the step's collective across groups, up to that collective's deadline: with
        # only that deadline of its own, a process whose collective failed at once (its peer
        # died) gives up as a process whose peer stalls reaches the vote, and a survivor
        # group stops. Twice the deadline: the collective's, and as much again for the rest.
        self._vote_timeout = 2 * step
        self._alone = group_size == 1 and all(
            hasattr(self._manager, name) for name in _COMMIT_FIELDS)
        from torch.distributed import AllreduceOptions, ReduceOp
        from torch.distributed.distributed_c10d import AllgatherOptions

        # (read, never changed, by each collective)
        self._sum_options = AllreduceOptions()
        self._sum_options.reduceOp = ReduceOp(ReduceOp.SUM)
        self._gather_options = AllgatherOptions()
        self._on_accelerator = _accelerator()  # (then each vote synchronizes it)

    def _loaded(self, state: dict) -> None:
        self._load(state)
        self._healed = True

    def quorum(self, timeout_s: float | None = None) -> Quorum:
        """Meet the other groups for a step; a group behind heals here, before the step.
        ``timeout_s``: how long to wait for the quorum (default: the policy's)."""
        self._healed = False
        try:
            self._manager.start_quorum(
                timeout=timedelta(seconds=timeout_s) if timeout_s is not None else None)
        except Exception:
            # torchft 0.2.0 keeps the failed quorum's future, and the next start_quorum
            # would raise its error again: drop it, so that a later try starts afresh.
            self._manager._quorum_future = None
            raise
        # Read once a quorum: the manager's own reader waits on the quorum's future under a
        # profiler range each time.
        self._participants = self._manager.num_participants()
        self._leads = self._manager.participating_rank() == 0
        return Quorum(participants=self._participants, healed=self._healed)

    def again(self) -> Quorum:
        """The last quorum, for one more step, without a round trip to the lighthouse (the
        step before committed with every group in it). A group lost since makes the step's
        collective fail: the step does not commit, and the next quorum is a full one."""
        m = self._manager
        m._errored = None  # what start_quorum resets, with no quorum to wait for
        m._healing = False
        return Quorum(participants=self._participants, healed=False)

    def drop(self) -> None:
        """Close the process group across groups, after a step that did not commit here. A
        group whose step committed goes on without a quorum: its next collective then fails
        at once, instead of after its deadline, and it meets this group in the next quorum
        (which configures a new process group: a failed step changes the quorum's id)."""
        self._manager._pg.abort(errored=False)

    def fall_back(self, step: int) -> None:
        """This process holds ``step`` again (a heal that went through in only some of its
        group's processes: the group's next quorum heals every one of them, torchft
        reporting the step of whichever asks last), and the step under way is dropped."""
        self._manager._step = step
        self.drop()

    @property
    def healing(self) -> bool:
        """A heal under way in this process (a quorum left before the state was loaded: the
        manager's step may already be the source's)."""
        return self._manager._healing

    @property
    def participants(self) -> int:
        """Replica groups taking part in the step under way (its quorum's)."""
        return self._participants

    @property
    def leads(self) -> bool:
        """This group comes first of the groups in the last quorum (group 0 where it takes
        part: the quorum orders them by name)."""
        return self._leads

    @property
    def alone(self) -> bool:
        """One process a group (its commit vote is its own)."""
        return self._alone

    def average(self, tensors: Sequence[torch.Tensor], wire: torch.dtype | None = None,
                summed: int = 0) -> None:
        """Average ``tensors`` (flattened into one buffer) over the groups of this step; on
        a failure the step is marked as errored (``commit`` then says False).

        ``wire`` (float16, bfloat16): sent in that precision, divided by the groups before
        the sum as torch's compression hooks do inside a group (no overflow of the sum;
        the very rounding of one process group of that many ranks). The last ``summed``
        elements (of the last tensors) are summed, not averaged."""
        if not tensors:
            return
        import torch

        flat = torch.cat([t.reshape(-1) for t in tensors])
        averaged = flat.numel() - summed
        if wire is None:
            self.sum(flat)
            flat[:averaged] /= self._participants
        else:
            sent = flat.to(wire)
            sent[:averaged].div_(self._participants)
            self.sum(sent)
            flat = sent.to(flat.dtype)
        offset = 0
        for t in tensors:
            t.copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()

    def sum(self, tensor: torch.Tensor) -> None:
        """Sum ``tensor`` (any dtype) over the groups of this step, in place, on the process
        group the quorum configured (what the manager's allreduce does, without its futures
        and timers: a gloo collective has its own deadline). After a failure the step is
        marked as errored, and later collectives of the step are skipped."""
        self.start_sum(tensor).wait()

    def start_sum(self, tensor: torch.Tensor, then: After | None = None
                  ) -> torch.futures.Future[torch.Tensor]:
        """``sum``, started: the future's value is ``tensor``, summed in place once it is
        done (``then(tensor)`` where given: one callback, not a chain of two). It never
        fails: a failed sum marks the step as errored (its values are then not used, as the
        step does not commit), so that a DDP hook never raises."""
        options = self._sum_options
        return self._start(tensor, lambda pg: pg.allreduce([tensor], options),
                           lambda: tensor, lambda: tensor, then)

    def start_gather(self, tensor: torch.Tensor, then: After | None = None
                     ) -> torch.futures.Future[torch.Tensor]:
        """Every group's ``tensor`` (a 1-d tensor of the same length in each), as the rows
        of a (groups, length) tensor, on the process group the quorum configured (or
        ``then(rows)``, as ``start_sum``). Never fails, as ``start_sum``: a failed gather
        marks the step as errored (the step does not commit), and its rows are then
        zeros."""
        options, length = self._gather_options, tensor.numel()
        rows: list[torch.Tensor] = []

        def launch(pg: Any) -> Any:
            rows.append(tensor.new_empty(pg.size() * length))
            return pg.allgather_into_tensor_coalesced(rows, [tensor], options)

        return self._start(tensor, launch, lambda: rows[0].view(-1, length),
                           lambda: tensor.new_zeros(1, length), then)

    def _start(self, tensor: torch.Tensor, launch: Callable[[Any], Any],
               result: Callable[[], torch.Tensor], failed: Callable[[], torch.Tensor],
               then: After | None = None) -> torch.futures.Future[torch.Tensor]:
        """A collective of ``tensor`` across the groups (``launch(process group)`` starts
        it; the future's value is then ``result()``, or ``failed()`` where it fails, passed
        through ``then`` where given). A group that does not take part in the step sends
        zeros."""
        m = self._manager
        after = then if then is not None else _same

        def skipped() -> torch.futures.Future[torch.Tensor]:  # (then: inside the future)
            return _done(failed()).then(lambda done: after(done.value()))

        if m.errored():
            # A step's collectives after its first failure are skipped, and the process
            # group closed: a group whose earlier collective of the step went through waits
            # for this one in the next, which then fails at once instead of after its
            # deadline.
            self.drop()
            return skipped()
        if not m.is_participating():
            tensor.zero_()
        try:
            # On torch's process group that torchft's wraps: its wrapper adds only Python
            # calls (about 40 us a collective, a third of the launch) and nothing for gloo.
            started = launch(m._pg.parent).get_future()
        except Exception as exc:  # noqa: BLE001 - the process group is already gone
            m.report_error(exc)
            return skipped()

        def finished(future: torch.futures.Future) -> torch.Tensor:
            try:
                future.wait()
            except Exception as exc:  # noqa: BLE001 - a lost group, a timeout
                m.report_error(exc)
                return after(failed())
            return after(result())

        return started.then(finished)

    def abstain(self) -> None:
        """Vote against committing the step under way (every group then does it again)."""
        self._manager.report_error(RuntimeError("a replica group is catching up"))

    @property
    def step(self) -> int:
        """Steps committed (the same in every group of a quorum)."""
        return self._manager.current_step()

    def commit(self) -> bool:
        """Whether every group of the step may apply it: nothing failed, and under 'exact'
        every group took part (the manager's minimum replica count)."""
        if not self._alone:
            return self._manager.should_commit(timeout=self._vote_timeout)
        # One process a group: the vote inside the group is this process's own, so the
        # round trip to the group's manager server that should_commit makes is skipped;
        # the rest is torchft 0.2.0's should_commit, line for line.
        m = self._manager
        if m._recovery_event is not None:
            m._recovery_event.synchronize()
            m._recovery_event = None
        if self._on_accelerator:
            import torch

            torch.accelerator.synchronize()
        if err := m._pg.errored():
            m.report_error(err)
        if m._healing:
            m._apply_pending_state_dict()
        participants = self._participants
        ok = participants >= m._min_replica_size and m._errored is None
        m._checkpoint_transport.disallow_checkpoint()
        if ok:
            m._step += 1
            m._batches_committed += participants
            m._commit_failures = 0
        else:
            m._commit_failures += 1
        return ok

    @property
    def errored(self) -> bool:
        return self._manager.errored() is not None

    def close(self) -> None:
        self._manager.shutdown(wait=False)


class _UniqueQuorumIds:
    """torchft's manager client, whose quorums' ids are made unique across lighthouses.

    A manager configures a new process group only where a quorum's id differs from the
    last one's, under a store prefix made of that id. A lighthouse started again (the
    launcher does, on the same address) counts its ids from the start: a group that lived
    through it may hold the very id of the new lighthouse's first quorum and keep its old
    process group, which a replacement cannot join (about 50 s lost, then a failed step),
    or configure one under a prefix the store has held since the job began. The id here
    is new where the lighthouse's id or the members changed since this process's last
    quorum (a process's member id is new at each start), made of both and the quorum's
    step: the same in every group of the quorum, and not one a store saw before."""

    def __init__(self, client: Any):
        self._client = client
        self._last: tuple[int, list[str]] | None = None  # the lighthouse's id, the members
        self._id = -1

    def _quorum(self, *args: Any, **kwargs: Any) -> Any:
        quorum = self._client._quorum(*args, **kwargs)
        seen = (quorum.quorum_id, sorted(quorum.replica_ids))
        if seen != self._last:
            self._last = seen
            key = f"{seen[0]}/{quorum.max_step}/{','.join(seen[1])}".encode()
            self._id = int.from_bytes(hashlib.blake2b(key, digest_size=7).digest(), "big")
        quorum.quorum_id = self._id
        return quorum

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)


def _same(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def _done(tensor: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    import torch

    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(tensor)
    return future
