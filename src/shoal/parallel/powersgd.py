"""PowerSGD (torch's hook) with its state kept per parameter, so a resume is exact.

torch's ``powerSGD_hook`` keeps its error feedback and warm-start matrices per bucket
index. DDP cuts its buckets differently in the first step than after (it regroups them by
the order gradients become ready), and a resumed run starts with the first-step cut again.
This wrapper translates the state to per-parameter tensors whenever the cut changes, and
for checkpoints, so the compression continues exactly where it stopped.
"""

from __future__ import annotations

from typing import cast

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import (
    PowerSGDState,
    _should_compress,
    powerSGD_hook,
)

from shoal.parallel.traffic import Traffic, all_reduce_bytes

Layout = tuple[tuple[str, torch.Size], ...]


def _compressed(layout: Layout, rank: int, min_rate: float) -> list[tuple[str, int, int, int]]:
    """(name, n, m, r) of the tensors PowerSGD compresses, in the order of its P/Q memory."""
    groups: dict[tuple[int, int], list[tuple[str, int, int, int]]] = {}
    for name, shape in layout:
        n = shape[0]
        m = shape.numel() // n
        r = min(n, m, rank)
        if _should_compress(n, m, r, min_rate)[0]:
            groups.setdefault((n, m), []).append((name, n, m, r))
    return [entry for group in groups.values() for entry in group]


class PowerSGDHook:
    """State and hook: ``model.register_comm_hook(state, PowerSGDHook.hook)``."""

    def __init__(self, model: nn.Module, rank: int, warmup_steps: int, traffic: Traffic,
                 seed: int = 0, group: dist.ProcessGroup | None = None):
        self.state = PowerSGDState(process_group=group, matrix_approximation_rank=rank,
                                   start_powerSGD_iter=warmup_steps, use_error_feedback=True,
                                   warm_start=True, random_seed=seed)
        self.traffic = traffic
        self.world = dist.get_world_size(group)
        self.names: dict[torch.Tensor, str] = {p: name for name, p in model.named_parameters()}
        self.layouts: dict[int, Layout] = {}  # the cut torch's per-bucket state follows
        self.errors: dict[str, torch.Tensor] = {}  # per-parameter state between cuts
        self.qs: dict[str, torch.Tensor] = {}
        self._held: list[tuple[dist.GradBucket, torch.futures.Future]] = []

    @staticmethod
    def hook(self, bucket):  # no annotations: DDP checks them literally
        # torch's hook chains collectives in callbacks on gloo's threads; with several
        # buckets in flight their order differs between ranks (a collective mismatch on
        # gloo). Buckets are held back and compressed one after the other at the last one.
        future = torch.futures.Future()
        self._held.append((bucket, future))
        if bucket.is_last():
            held, self._held = self._held, []
            self.traffic.launched()
            for bucket, future in held:
                try:
                    future.set_result(self._compress(bucket).wait())
                except Exception as exc:  # noqa: BLE001 - handed to DDP, which raises it
                    future.set_exception(exc)
            self.traffic.done()
        return future

    def _compress(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        s = self.state
        buffer = bucket.buffer()
        compressing = s.iter >= s.start_powerSGD_iter
        if compressing:
            layout = tuple((self.names[p], p.shape) for p in bucket.parameters())
            index = bucket.index()
            if self.layouts.get(index, layout) != layout:  # DDP regrouped its buckets
                self._to_parameters()
            if index not in self.layouts:
                self._to_bucket(index, layout, buffer)
                self.layouts[index] = layout
        before = s.total_numel_after_compression
        future = powerSGD_hook(s, bucket)
        numel = s.total_numel_after_compression - before if compressing else buffer.numel()
        self.traffic.sent(all_reduce_bytes(numel * buffer.element_size(), self.world))
        return future

    # -- between the per-bucket state of torch's hook and per-parameter tensors ------------

    def _split(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        s = self.state
        errors, qs = dict(self.errors), dict(self.qs)
        for index, layout in self.layouts.items():
            if index in s.error_dict:
                sizes = [shape.numel() for _, shape in layout]
                for (name, _), part in zip(layout, s.error_dict[index].split(sizes),
                                           strict=True):
                    errors[name] = part.clone()
            if index in s.q_memory_dict:
                entries = _compressed(layout, s.matrix_approximation_rank,
                                      s.min_compression_rate)
                parts = s.q_memory_dict[index].split([m * r for _, _, m, r in entries])
                for (name, *_), part in zip(entries, parts, strict=True):
                    qs[name] = part.clone()
        return errors, qs

    def _to_parameters(self) -> None:
        self.errors, self.qs = self._split()
        s = self.state
        s.error_dict.clear()
        s.p_memory_dict.clear()
        s.q_memory_dict.clear()
        self.layouts.clear()

    def _to_bucket(self, index: int, layout: Layout, buffer: torch.Tensor) -> None:
        s = self.state
        names = [name for name, _ in layout]
        if names and all(name in self.errors for name in names):
            s.error_dict[index] = torch.cat([self.errors[n].reshape(-1) for n in names]).to(
                buffer)
        entries = _compressed(layout, s.matrix_approximation_rank, s.min_compression_rate)
        if entries and all(name in self.qs for name, *_ in entries):
            s.q_memory_dict[index] = torch.cat([self.qs[name] for name, *_ in entries]).to(
                buffer)
            s.p_memory_dict[index] = buffer.new_empty(sum(n * r for _, n, _, r in entries))

    # -- checkpoints ------------------------------------------------------------------------

    def state_dict(self) -> dict:
        errors, qs = self._split()
        # legacy form: a tuple (the dict form is only for bit generators other than MT19937)
        kind, keys, pos, has_gauss, cached = cast("tuple[str, np.ndarray, int, int, float]",
                                                  self.state.rng.get_state())
        return {"iter": self.state.iter, "errors": errors, "qs": qs,
                "rng": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)),
                        "pos": int(pos), "has_gauss": int(has_gauss),
                        "cached_gaussian": float(cached)}}

    def load_state_dict(self, state: dict) -> None:
        s = self.state
        s.iter = state["iter"]
        rng = state["rng"]
        s.rng.set_state((rng["kind"], rng["keys"].numpy().astype(np.uint32), rng["pos"],
                         rng["has_gauss"], rng["cached_gaussian"]))
        s.error_dict.clear()
        s.p_memory_dict.clear()
        s.q_memory_dict.clear()
        self.layouts.clear()
        self.errors = {k: v.clone() for k, v in state["errors"].items()}
        self.qs = {k: v.clone() for k, v in state["qs"].items()}
