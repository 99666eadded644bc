"""The wire format of a remote call: one JSON header, then the tensors' raw bytes in chunks.

Every call of the remote tier is one gRPC stream each way. The first message of a stream is
a UTF-8 JSON object (the header); it lists the tensors that follow as ``{"name", "dtype",
"shape"}``. Their bytes (C order, the machine's byte order) follow concatenated, cut into
messages of at most ``CHUNK`` bytes, so a tensor of any size stays under gRPC's message
limit and never needs a second copy in a serialiser.

A reader trusts nothing it is sent: the header's shapes and dtypes are checked, their total
size is held against a limit before any byte of them is taken, and the bytes are kept as
they arrive, so a header that declares more than it sends costs nothing.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from typing import Any, cast

import torch

CHUNK = 1 << 20  # bytes per message: a quarter of gRPC's default 4 MiB limit
MAX_MESSAGE = 4 * CHUNK  # what either side accepts, header included
MAX_CALL_BYTES = 1 << 30  # tensor bytes one call may declare (the server's default limit)
MAX_DIMS = 32
MAX_NUMEL = 1 << 48
MAX_NAME = 200  # characters of a tensor's name quoted in an error

_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128)}


class WireError(ValueError):
    """A stream that does not follow the format (a peer of another version, a cut stream)."""


def _raw(tensor: torch.Tensor) -> memoryview:
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    # ignore: numpy's stub gives ndarray no __buffer__ before Python 3.12; it is a buffer
    return (memoryview(flat.view(torch.uint8).numpy())  # type: ignore[arg-type]
            if flat.numel() else memoryview(b""))


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


class Decoder:
    """Reads one stream message by message: ``header(first)`` checks the header's tensor
    specs against ``max_bytes`` before any byte of them arrives; ``feed`` keeps the bytes
    as they come (what is held grows with what was sent, never with what was declared);
    ``tensors`` joins them once (one copy, as a buffer filled in place would cost) and
    cuts them into tensors once the stream ended."""

    def __init__(self, max_bytes: int | None = MAX_CALL_BYTES):
        self.max_bytes = max_bytes
        self.specs: list[tuple[str, torch.dtype, list[int], int]] = []
        self.expected = 0
        self.pieces: list[bytes] = []  # joined once at the end: one copy, as they came
        self.received = 0

    def header(self, first: bytes) -> dict[str, Any]:
        try:
            header = json.loads(first)
        except (ValueError, RecursionError) as exc:
            raise WireError(f"the first message is not a JSON header ({exc})") from None
        if not isinstance(header, dict):
            kind = {list: "array", str: "string", bool: "boolean", type(None): "null"}.get(
                type(header), "number")
            raise WireError(f"the header is a JSON {kind}, not an object")
        specs = header.pop("tensors", [])
        if not isinstance(specs, list):
            raise WireError("the header's 'tensors' is not a list")
        names = set()
        for spec in specs:
            name, dtype, shape, size = _spec(spec)
            if name in names:
                raise WireError(f"tensor {name!r} is listed twice")
            names.add(name)
            self.expected += size
            if self.max_bytes is not None and self.expected > self.max_bytes:
                raise WireError(f"the header lists {self.expected:,}+ bytes of tensors; this "
                                f"server takes at most {self.max_bytes:,} per call")
            self.specs.append((name, dtype, shape, size))
        return header

    @property
    def names(self) -> set[str]:
        return {name for name, *_ in self.specs}

    def feed(self, message: bytes) -> None:
        self.received += len(message)
        if self.received > self.expected:
            raise WireError(f"the stream holds more than the {self.expected:,} bytes of "
                            "tensors its header lists")
        self.pieces.append(message)

    def tensors(self, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
        if self.received != self.expected:
            raise WireError(f"the stream holds {self.received} bytes of tensors; the header "
                            f"lists {self.expected} (cut short?)")
        body = bytearray().join(self.pieces)  # writable: tensors are made on it, not copied
        self.pieces = []
        view, offset, tensors = memoryview(body), 0, {}
        for name, dtype, shape, size in self.specs:
            if size:
                flat = torch.frombuffer(view[offset:offset + size], dtype=dtype)
            else:
                flat = torch.empty(0, dtype=dtype)
            tensors[name] = flat.reshape(shape).to(device)
            offset += size
        return tensors


def _spec(spec: Any) -> tuple[str, torch.dtype, list[int], int]:
    """A tensor spec's name, dtype, shape and size in bytes, or WireError saying why not."""
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
        raise WireError(f"a tensor spec must be an object with a string 'name', not "
                        f"{str(spec)[:60]}")
    name = spec["name"][:MAX_NAME]
    dtype = (_DTYPES.get(cast(str, spec.get("dtype"))) if isinstance(spec.get("dtype"), str)
             else None)
    if dtype is None:
        raise WireError(f"tensor {name!r}: unknown dtype {str(spec.get('dtype'))[:30]!r}")
    shape = spec.get("shape")
    if (not isinstance(shape, list) or len(shape) > MAX_DIMS
            or not all(type(d) is int and d >= 0 for d in shape)):
        raise WireError(f"tensor {name!r}: shape {str(shape)[:60]} is not a list of at most "
                        f"{MAX_DIMS} non-negative integers")
    numel, span = 1, 1
    for dim in shape:  # Python ints: a product past any limit is caught, never wrapped
        numel *= dim
        span *= max(dim, 1)  # a zero dim must not hide the others from torch's int64
    if span > MAX_NUMEL:
        raise WireError(f"tensor {name!r}: shape {str(shape)[:60]} has more than "
                        f"{MAX_NUMEL:,} elements")
    return spec["name"], dtype, shape, numel * dtype.itemsize


def decode(messages: Iterable[bytes], device: torch.device | str = "cpu",
           max_bytes: int | None = MAX_CALL_BYTES
           ) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The header and the tensors of one stream (on ``device``)."""
    stream = iter(messages)
    try:
        first = next(stream)
    except StopIteration:
        raise WireError("empty stream: no header") from None
    decoder = Decoder(max_bytes)
    header = decoder.header(first)
    for message in stream:
        decoder.feed(message)
    return header, decoder.tensors(device)
