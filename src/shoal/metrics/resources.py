"""CPU, memory and (on CUDA, through NVML) GPU use of this rank, sampled in the background."""

from __future__ import annotations

import threading

import psutil
import torch

FIELDS = ("cpu_percent", "rss_bytes", "gpu_util_percent", "gpu_memory_bytes")


def _nvml_handle(device: torch.device):
    """An NVML handle for ``device``, or None without CUDA or without nvidia-ml-py."""
    if device.type != "cuda":
        return None
    try:
        import pynvml  # nvidia-ml-py, optional

        pynvml.nvmlInit()
        index = device.index if device.index is not None else torch.cuda.current_device()
        return pynvml.nvmlDeviceGetHandleByIndex(index)
    except Exception:  # noqa: BLE001 - no NVML: GPU figures are left out
        return None


def memory_limit() -> int:
    """Bytes this process's memory may reach: its cgroup's limit where one is set, else the
    machine's memory."""
    total = psutil.virtual_memory().total
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            text = f.read().strip()
    except OSError:
        return total
    return min(int(text), total) if text.isdigit() else total


class ResourceSampler:
    """Samples every ``interval`` seconds; ``take()`` returns the means since the last call
    (NaN for figures this machine does not have)."""

    def __init__(self, device: torch.device, interval: float = 1.0):
        self.interval = interval
        self.process = psutil.Process()
        self.process.cpu_percent(None)  # the first call only starts the measurement
        self.nvml = _nvml_handle(device)
        self._lock = threading.Lock()
        self._sums = dict.fromkeys(FIELDS, 0.0)
        self._count = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="shoal-resources", daemon=True)

    def start(self) -> ResourceSampler:
        self._sample()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def _sample(self) -> None:
        values = {"cpu_percent": self.process.cpu_percent(None),
                  "rss_bytes": float(self.process.memory_info().rss),
                  "gpu_util_percent": float("nan"), "gpu_memory_bytes": float("nan")}
        if self.nvml is not None:
            import pynvml

            values["gpu_util_percent"] = float(pynvml.nvmlDeviceGetUtilizationRates(
                self.nvml).gpu)
            values["gpu_memory_bytes"] = float(pynvml.nvmlDeviceGetMemoryInfo(self.nvml).used)
        with self._lock:
            for key, value in values.items():
                self._sums[key] += value
            self._count += 1

    def take(self) -> dict[str, float]:
        if self._count == 0:  # a window shorter than the interval: sample it now
            self._sample()
        with self._lock:
            means = {k: v / self._count for k, v in self._sums.items()}
            self._sums = dict.fromkeys(FIELDS, 0.0)
            self._count = 0
        return means
