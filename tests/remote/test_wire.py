"""The wire format: tensors of every size and dtype come back bit for bit, cut into
messages below the limit; a stream cut short or malformed is named."""

from __future__ import annotations

import pytest
import torch

from shoal.remote import wire


@pytest.mark.parametrize("numel", [0, 1, 1000, wire.CHUNK // 4 - 1, wire.CHUNK // 4 + 1,
                                   3 * wire.CHUNK // 4 + 7])
def test_round_trip_bit_exact_in_messages_below_the_limit(numel):
    gen = torch.Generator().manual_seed(numel)
    tensors = {"x": torch.randn(numel, generator=gen),
               "half": torch.randn(5, 3, generator=gen).to(torch.bfloat16),
               "scalar": torch.tensor(7, dtype=torch.int64),
               "mask": torch.rand(4, generator=gen) > 0.5,
               "strided": torch.randn(6, 4, generator=gen).t()}
    messages = list(wire.encode({"op": "forward"}, tensors))
    assert all(len(m) <= wire.CHUNK for m in messages[1:])
    assert sum(map(len, messages[1:])) == sum(t.numel() * t.element_size()
                                              for t in tensors.values())
    header, back = wire.decode(messages)
    assert header == {"op": "forward"}
    assert back.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert back[name].dtype == tensor.dtype and back[name].shape == tensor.shape
        assert torch.equal(back[name], tensor), name


def test_a_stream_cut_short_or_malformed_is_named():
    messages = list(wire.encode({}, {"x": torch.ones(1000)}))
    with pytest.raises(wire.WireError, match="holds 3999 bytes of tensors; the header lists 4000"):
        wire.decode([messages[0], messages[1][:-1]])
    with pytest.raises(wire.WireError, match="not a JSON header"):
        wire.decode([b"\x00garbage"])
    with pytest.raises(wire.WireError, match="no header"):
        wire.decode([])
    with pytest.raises(wire.WireError, match="unknown dtype 'float8'"):
        wire.decode([b'{"tensors": [{"name": "x", "dtype": "float8", "shape": [1]}]}'])
