"""Lines are read from a byte offset: never twice, and never half."""

from __future__ import annotations

from shoal.dashboard import tail
from shoal.dashboard.tail import LineTail


def test_a_partial_last_line_waits_until_it_is_whole(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b'{"a": 1}\n{"b": 2}\n{"c":')
    t = LineTail(path)
    assert list(t.lines()) == [b'{"a": 1}', b'{"b": 2}']
    assert t.offset == len(b'{"a": 1}\n{"b": 2}\n')
    assert list(t.lines()) == [] and t.grew()  # the half line is there, not yet read
    with open(path, "ab") as f:
        f.write(b' 3}\n{"d": 4}\n')
    assert list(t.lines()) == [b'{"c": 3}', b'{"d": 4}']
    assert list(t.lines()) == [] and t.offset == path.stat().st_size


def test_only_new_bytes_are_read(tmp_path, monkeypatch):
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b"".join(b"line %d\n" % i for i in range(1000)))
    reads = []
    real_open = open

    def counting_open(name, mode="r", *args, **kwargs):
        handle = real_open(name, mode, *args, **kwargs)
        original = handle.readinto
        handle.readinto = lambda buffer: reads.append(n := original(buffer)) or n
        return handle

    monkeypatch.setattr(tail, "CHUNK", 1000)  # lines straddle chunk ends
    monkeypatch.setattr("builtins.open", counting_open)
    t = LineTail(path)
    assert [int(x.split()[1]) for x in t.lines()] == list(range(1000))
    first = sum(reads)
    assert first == path.stat().st_size
    with real_open(path, "ab") as f:
        f.write(b"line 1000\n")
    assert list(t.lines()) == [b"line 1000"]
    assert sum(reads) - first == len(b"line 1000\n")


def test_a_file_started_anew_is_read_from_its_start(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b"one\ntwo\nthree\n")
    t = LineTail(path)
    assert len(list(t.lines())) == 3
    path.write_bytes(b"new\n")
    assert list(t.lines()) == [b"new"] and t.replaced


def test_a_missing_file_is_no_error(tmp_path):
    t = LineTail(tmp_path / "metrics.jsonl")
    assert list(t.lines()) == [] and not t.grew()


def test_a_line_longer_than_the_buffer_is_read_whole(tmp_path, monkeypatch):
    monkeypatch.setattr(tail, "CHUNK", 64)
    path = tmp_path / "metrics.jsonl"
    long = b"x" * 1000
    path.write_bytes(b"a\n" + long + b"\nb\n" + long)
    t = LineTail(path)
    assert list(t.lines()) == [b"a", long, b"b"]
    with open(path, "ab") as f:
        f.write(b"\n")
    assert list(t.lines()) == [long] and t.offset == path.stat().st_size


def test_a_line_too_long_to_be_a_record_is_skipped_not_held(tmp_path, monkeypatch):
    monkeypatch.setattr(tail, "CHUNK", 64)
    monkeypatch.setattr(tail, "MAX_LINE", 256)
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b"a\n" + b"x" * 300)  # still being written, already too long
    t = LineTail(path)
    assert list(t.lines()) == [b"a"] and t.skipped == 1
    with open(path, "ab") as f:
        f.write(b"x" * 5000)  # more of it: not read into memory, nor counted again
    assert list(t.lines()) == [] and t.skipped == 1 and t.offset == path.stat().st_size
    with open(path, "ab") as f:
        f.write(b"x" * 10 + b"\nb\n" + b"y" * 100 + b"\nc\n" + b"z" * 1000 + b"\nd\n")
    assert list(t.lines()) == [b"b", b"y" * 100, b"c", b"d"] and t.skipped == 2
    assert t.offset == path.stat().st_size
