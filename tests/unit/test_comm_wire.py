"""Control messages between ranks: plain tagged bytes, every malformed message refused
(hpcmac.comm.wire), no pickle on the pipeline or the MLX ring."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest

from hpcmac.comm import wire
from hpcmac.llm.parallel.results import RankStats

ROOT = Path(__file__).resolve().parents[2]


def test_round_trip():
    obj = {"add": [(1, [5, 6], {"temperature": 0.5, "seed": None})], "free": [(2, 3)],
           "b": b"\x00\xff", "ok": True, "f": -1.5, "s": "é", "n": -(2**63),
           "a": np.arange(6, dtype=np.float32).reshape(2, 3), "x": np.int64(7)}
    got = wire.decode(wire.encode(obj))
    assert got.keys() == obj.keys()
    for k in obj:
        if isinstance(obj[k], np.ndarray):
            assert got[k].dtype == obj[k].dtype and np.array_equal(got[k], obj[k])
        else:
            assert got[k] == obj[k] and type(got[k]) is type(obj[k])
    stats = RankStats(1, "mac2", (0, 15))
    assert wire.decode(wire.encode(stats)) == stats


def test_refuses_what_it_cannot_send_or_read():
    for bad in (object(), {1, 2}, np.array([object()]), lambda: 0):
        with pytest.raises(TypeError):
            wire.encode(bad)
    for big in (2**63, -(2**63) - 1, 2**70, {"seed": 2**70}):  # a clear error, not struct's
        with pytest.raises(ValueError, match="64 at most"):
            wire.encode(big)
    crafted = [
        b"", b"Z", b"s\xff\xff\xff\xff", b"l\xff\xff\xff\x7f", b"N extra",
        b"s\x02\x00\x00\x00\xff\xfe",
        wire.encode(["x"] * 3)[:-1],
        b"c" + wire.encode("os:system") + wire.encode({}),
        b"c" + wire.encode("hpcmac.comm.wire:decode") + wire.encode({}),
        b"c" + wire.encode("hpcmac.llm.parallel.results:RankStats") + wire.encode({"rm": 1}),
        b"a" + wire.encode(("|O", (1,), False)) + b"\x08\x00\x00\x00" + b"\x00" * 8,
        b"a" + wire.encode(("<f8", (10**6,), False)) + b"\x08\x00\x00\x00" + b"\x00" * 8,
        b"l\x01\x00\x00\x00" * 10000 + b"N",
    ]
    for data in crafted:
        with pytest.raises(wire.WireError):
            wire.decode(data)


def test_random_mutations_are_refused_or_plain():
    """Every mutation decodes to plain data or raises WireError: nothing else escapes."""
    rng = random.Random(19)
    base = wire.encode({"add": [(1, [5, 6], {"temperature": 0.5})], "a": np.ones(3)})
    for _ in range(5000):
        b = bytearray(base)
        for _ in range(rng.randint(1, 4)):
            b[rng.randrange(len(b))] = rng.randrange(256)
        try:
            wire.decode(bytes(b))
        except wire.WireError:
            pass


def test_no_pickle_on_the_wire():
    for rel in ("hpcmac/llm/parallel/pipeline.py", "hpcmac/comm/mlx.py",
                "hpcmac/llm/parallel/link.py", "hpcmac/llm/parallel/tensor.py"):
        text = (ROOT / rel).read_text()
        assert "pickle" not in text.replace("never pickle", ""), rel
