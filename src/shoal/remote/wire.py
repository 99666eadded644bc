"""The wire format of a remote call: one JSON header, then the tensors' raw bytes in chunks.

Every call of the remote tier is one gRPC stream each way. The first message of a stream is
a UTF-8 JSON object (the header); it lists the tensors that follow as ``{"name", "dtype",
"shape"}``. Their bytes (C order, the machine's byte order) follow concatenated, cut into
messages of at most ``CHUNK`` bytes, so a tensor of any size stays under gRPC's message
limit and never needs a second copy in a serialiser.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from typing import Any

import torch

CHUNK = 1 << 20  # bytes per message: a quarter of gRPC's default 4 MiB limit
MAX_MESSAGE = 4 * CHUNK  # what either side accepts, header included

_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128)}


class WireError(ValueError):
    """A stream that does not follow the format (a peer of another version, a cut stream)."""


def _raw(tensor: torch.Tensor) -> memoryview:
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")


def encode(header: dict[str, Any], tensors: dict[str, torch.Tensor],
           chunk: int = CHUNK) -> Iterator[bytes]:
    """The messages of one stream: the header (with the tensors' specs), then the bytes."""
    specs = []
    for name, tensor in tensors.items():
        dtype = str(tensor.dtype).removeprefix("torch.")
        if dtype not in _DTYPES:
            raise WireError(f"tensor {name!r}: dtype {tensor.dtype} cannot be sent")
        specs.append({"name": name, "dtype": dtype, "shape": list(tensor.shape)})
    yield json.dumps({**header, "tensors": specs}).encode()
    pending = bytearray()
    for tensor in tensors.values():
        raw = _raw(tensor)
        start = 0
        if pending:  # fill the last partial chunk first: messages stay full-sized
            take = min(chunk - len(pending), len(raw))
            pending += raw[:take]
            start = take
            if len(pending) == chunk:
                yield bytes(pending)
                pending = bytearray()
        while len(raw) - start >= chunk:
            yield bytes(raw[start:start + chunk])
            start += chunk
        pending += raw[start:]
    if pending:
        yield bytes(pending)


def decode(messages: Iterable[bytes], device: torch.device | str = "cpu"
           ) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The header and the tensors of one stream (on ``device``)."""
    stream = iter(messages)
    try:
        first = next(stream)
    except StopIteration:
        raise WireError("empty stream: no header") from None
    try:
        header = json.loads(first)
    except ValueError as exc:
        raise WireError(f"the first message is not a JSON header ({exc})") from None
    specs = header.pop("tensors", [])
    sizes = []
    for spec in specs:
        dtype = _DTYPES.get(spec.get("dtype"))
        if dtype is None:
            raise WireError(f"tensor {spec.get('name')!r}: unknown dtype {spec.get('dtype')!r}")
        numel = 1
        for dim in spec["shape"]:
            numel *= int(dim)
        sizes.append(numel * dtype.itemsize)
    body = bytearray(sum(sizes))  # filled in place: no copies as it grows
    view, filled = memoryview(body), 0
    for message in stream:
        end = filled + len(message)
        if end <= len(body):
            view[filled:end] = message
        filled = end
    if filled != len(body):
        raise WireError(f"the stream holds {filled} bytes of tensors; the header lists "
                        f"{len(body)} (cut short?)")
    tensors, offset = {}, 0
    for spec, size in zip(specs, sizes, strict=True):
        dtype = _DTYPES[spec["dtype"]]
        if size:
            flat = torch.frombuffer(view[offset:offset + size], dtype=dtype)
        else:
            flat = torch.empty(0, dtype=dtype)
        tensors[spec["name"]] = flat.reshape(spec["shape"]).to(device)
        offset += size
    return header, tensors
