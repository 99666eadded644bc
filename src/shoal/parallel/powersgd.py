"""PowerSGD: torch's algorithm (``powerSGD_hook``), its state kept per parameter and its
products computed on tensors of their own, so that a resume or a heal is exact.

torch's hook keeps its error feedback and warm-start matrices per bucket, and multiplies
views of the bucket at their offsets in it. DDP cuts its buckets differently in a process's
first step than after (it regroups them by the order gradients become ready), so a process
that resumes or heals redoes a step with another cut: other offsets. The CPU's BLAS (MKL)
rounds a product of the same values differently at another alignment (seen with rank 1,
where the product is a matrix-vector one), and the run would drift from the one it
continues. Here every product is taken on a tensor allocated for it (aligned alike whatever
the cut), and the state is kept by parameter name; the steps, the collectives (three
all-reduces per bucket) and the random start of the Q matrices are torch's.

That random start does follow the cut: a bucket's Qs are drawn, in the order of its
parameters, at the first compressed step. A run draws them after its first step (the
warm-up is at least two steps), with the cut DDP settles on; a process whose first
backward is that step (one that resumes or heals at the end of the warm-up) would draw
them with its first cut, in another order, and the run would go on from other Qs. Such a
process settles DDP's buckets first (``draws_due``, ``shoal.training.settling``).
"""

from __future__ import annotations

from collections import defaultdict
from typing import cast

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import (
    PowerSGDState,
    _orthogonalize,
    _should_compress,
)

from shoal.parallel.comm import Comm
from shoal.parallel.traffic import Traffic, all_reduce_bytes


class PowerSGDHook(Comm):
    """State and hook: ``model.register_comm_hook(state, PowerSGDHook.hook)``."""

    def __init__(self, model: nn.Module, rank: int, warmup_steps: int, traffic: Traffic,
                 seed: int = 0, group: dist.ProcessGroup | None = None):
        # torch's settings and counters: the rank, the warm-up, the step, the random state.
        self.state = PowerSGDState(process_group=group, matrix_approximation_rank=rank,
                                   start_powerSGD_iter=warmup_steps, use_error_feedback=True,
                                   warm_start=True, random_seed=seed)
        self.group = group
        self.traffic = traffic
        self.world = dist.get_world_size(group)
        self.names: dict[torch.Tensor, str] = {p: name for name, p in model.named_parameters()}
        self.errors: dict[str, torch.Tensor] = {}  # what was not sent, by parameter
        self.qs: dict[str, torch.Tensor] = {}  # the warm-start Q of each compressed one
        self._held: list[tuple[dist.GradBucket, torch.futures.Future]] = []
        self.settled = False
        """This process's DDP has been through a backward: its buckets are cut for good."""

    @staticmethod
    def hook(self, bucket):  # no annotations: DDP checks them literally
        # Buckets are held back and compressed one after the other at the last one (with
        # several in flight, collectives chained on gloo's threads differ in order between
        # ranks).
        future = torch.futures.Future()
        self._held.append((bucket, future))
        if bucket.is_last():
            self.settled = True  # (the next forward cuts the buckets for good)
            held, self._held = self._held, []
            self.traffic.launched()
            for bucket, future in held:
                try:
                    future.set_result(self._compress(bucket))
                except Exception as exc:  # noqa: BLE001 - handed to DDP, which raises it
                    future.set_exception(exc)
            self.traffic.done()
        return future

    @property
    def draws_due(self) -> bool:
        """The next backward draws the random Qs (the first compressed step) and would do
        so with DDP's first cut of the buckets: settle them first (see the module's
        docstring)."""
        s = self.state
        return not self.settled and s.iter >= s.start_powerSGD_iter and not self.qs

    def _all_reduce(self, flat: torch.Tensor) -> torch.Tensor:
        if self.world > 1:  # one process (a live replica group of one): nothing to sum
            dist.all_reduce(flat, group=self.group)
        self.traffic.sent(all_reduce_bytes(flat.numel() * flat.element_size(), self.world))
        return flat

    def _compress(self, bucket: dist.GradBucket) -> torch.Tensor:
        """One bucket's step of torch's ``powerSGD_hook``; returns the bucket's buffer."""
        s = self.state
        buffer = bucket.buffer()
        if s.iter < s.start_powerSGD_iter:  # the warm-up: a plain mean
            s.maybe_increase_iter(bucket)
            return self._all_reduce(buffer).div_(self.world)
        names = [self.names[p] for p in bucket.parameters()]
        grads = bucket.gradients()
        # The gradient with what earlier steps did not send, in a tensor of its own.
        inputs = [g.detach().clone() for g in grads]
        for name, x in zip(names, inputs, strict=True):
            if name in self.errors:
                x.add_(self.errors[name])
        compressed: list[tuple[int, int, int, int]] = []  # (index, n, m, rank) of each
        plain: list[tuple[int, int, int, int]] = []
        for i, x in enumerate(inputs):
            n = x.shape[0]
            m = x.numel() // n
            r = min(n, m, s.matrix_approximation_rank)
            (compressed if _should_compress(n, m, r, s.min_compression_rate)[0]
             else plain).append((i, n, m, r))
        if plain:
            mean = self._all_reduce(torch.cat([inputs[i].reshape(-1) for i, *_ in plain]))
            mean.div_(self.world)
            for part, (i, *_) in zip(mean.split([inputs[i].numel() for i, *_ in plain]),
                                     plain, strict=True):
                grads[i].copy_(part.view_as(grads[i]))
        if compressed:
            self._low_rank(names, grads, inputs, compressed)
        for name, g, x in zip(names, grads, inputs, strict=True):
            self.errors[name] = x - g
        s.maybe_increase_iter(bucket)
        return buffer

    def _low_rank(self, names: list[str], grads: list[torch.Tensor],
                  inputs: list[torch.Tensor], compressed: list[tuple[int, int, int, int]]
                  ) -> None:
        """M ~ P Q^T for each compressed gradient M (one power iteration, warm-started),
        written into its gradient."""
        s = self.state
        # torch's order: grouped by shape, each shape in the order it first appears.
        by_shape: dict[tuple[int, int], list[tuple[int, int, int, int]]] = defaultdict(list)
        for entry in compressed:
            by_shape[entry[1:3]].append(entry)
        order = [entry for entries in by_shape.values() for entry in entries]
        ms = [inputs[i].view(1, n, m) for i, n, m, _ in order]
        if all(names[i] in self.qs for i, *_ in order):  # warm: the last step's Qs
            qs = [self.qs[names[i]].view(1, m, r).clone() for i, _, m, r in order]
        else:  # a bucket new to the compression: random Qs, as torch draws them
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(s.rng.randint(1_000_000_000))
                qs = [torch.randn(1, m, r, dtype=inputs[i].dtype).to(inputs[i].device)
                      for i, _, m, r in order]
        for q in qs:
            _orthogonalize(q, s.orthogonalization_epsilon)
        summed = self._all_reduce(torch.cat([torch.bmm(mat, q).reshape(-1)
                                             for mat, q in zip(ms, qs, strict=True)]))
        ps = [part.view(1, n, r).clone() for part, (_, n, _, r)
              in zip(summed.split([n * r for _, n, _, r in order]), order, strict=True)]
        for p in ps:
            _orthogonalize(p, s.orthogonalization_epsilon)
        summed = self._all_reduce(torch.cat([torch.bmm(mat.transpose(1, 2), p).reshape(-1)
                                             for mat, p in zip(ms, ps, strict=True)]))
        summed.div_(self.world)
        for part, p, (i, _, m, r) in zip(summed.split([m * r for _, _, m, r in order]), ps,
                                         order, strict=True):
            q = part.view(1, m, r).clone()
            self.qs[names[i]] = q.view(-1)
            grads[i].copy_(torch.bmm(p, q.transpose(1, 2)).view_as(grads[i]))

    # -- checkpoints ------------------------------------------------------------------------

    def state_dict(self) -> dict:
        # legacy form: a tuple (the dict form is only for bit generators other than MT19937)
        kind, keys, pos, has_gauss, cached = cast("tuple[str, np.ndarray, int, int, float]",
                                                  self.state.rng.get_state())
        return {"iter": self.state.iter,
                "errors": {k: v.clone() for k, v in self.errors.items()},
                "qs": {k: v.clone() for k, v in self.qs.items()},
                "rng": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)),
                        "pos": int(pos), "has_gauss": int(has_gauss),
                        "cached_gaussian": float(cached)}}

    def load_state_dict(self, state: dict) -> None:
        s = self.state
        s.iter = state["iter"]
        rng = state["rng"]
        s.rng.set_state((rng["kind"], rng["keys"].numpy().astype(np.uint32), rng["pos"],
                         rng["has_gauss"], rng["cached_gaussian"]))
        self.errors = {k: v.clone() for k, v in state["errors"].items()}
        self.qs = {k: v.clone() for k, v in state["qs"].items()}
