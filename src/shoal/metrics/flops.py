"""Peak FLOP/s of known GPUs, for model FLOPs utilization (MFU).

Dense (no sparsity) figures from the makers' data sheets, in TFLOP/s per GPU: tensor-core
bf16/fp16, TF32, and plain fp32. A name is matched by the first entry it contains, so
longer names come before their prefixes ("A100" before "A10"). A GPU not in the table, or
a CPU, has no peak: set ``trainer.metrics.peak_flops`` to get MFU there.
"""

from __future__ import annotations

import torch

# (name contains, bf16/fp16, tf32, fp32) in TFLOP/s.
_PEAKS: tuple[tuple[str, float, float, float], ...] = (
    ("GB200", 2500.0, 1250.0, 80.0),
    ("B200", 2250.0, 1100.0, 75.0),
    ("H100 PCIe", 756.0, 378.0, 51.0),
    ("H100 NVL", 835.0, 418.0, 60.0),
    ("H100", 989.4, 494.7, 66.9),
    ("H200", 989.4, 494.7, 66.9),
    ("H800", 989.4, 494.7, 66.9),
    ("GH200", 989.4, 494.7, 66.9),
    ("A100", 312.0, 156.0, 19.5),
    ("A800", 312.0, 156.0, 19.5),
    ("A10G", 70.0, 35.0, 31.2),
    ("A10", 125.0, 62.5, 31.2),
    ("L40S", 362.1, 183.0, 91.6),
    ("L40", 181.0, 90.5, 90.5),
    ("L4", 121.0, 60.0, 30.3),
    ("RTX 6000 Ada", 364.2, 182.1, 91.1),
    ("RTX A6000", 154.8, 77.4, 38.7),
    ("RTX 4090", 165.2, 82.6, 82.6),
    ("RTX 3090", 71.0, 35.6, 35.6),
    ("V100", 125.0, 15.7, 15.7),  # fp16 only: no bf16 or TF32 units
    ("MI300X", 1307.4, 653.7, 163.4),
    ("MI250X", 383.0, 47.9, 47.9),
)


def lookup(name: str) -> tuple[float, float, float] | None:
    """(bf16/fp16, tf32, fp32) peak FLOP/s of the GPU called ``name``, if known."""
    for key, half, tf32, fp32 in _PEAKS:
        if key in name:
            return half * 1e12, tf32 * 1e12, fp32 * 1e12
    return None


def peak_flops(device: torch.device, precision: str) -> float | None:
    """Peak FLOP/s of ``device`` for a run in ``precision`` ('32', 'bf16-mixed',
    'fp16-mixed'), or None where unknown (CPUs, GPUs not in the table). fp32 matmuls count
    at TF32 speed where torch is allowed to use it (``set_float32_matmul_precision``)."""
    if device.type != "cuda":
        return None
    peaks = lookup(torch.cuda.get_device_name(device))
    if peaks is None:
        return None
    half, tf32, fp32 = peaks
    if precision != "32":
        return half
    return tf32 if torch.get_float32_matmul_precision() != "highest" else fp32
