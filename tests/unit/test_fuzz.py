"""Bounded fuzzing of every input format: mutated HPL.dat, hostfiles, GGUF and safetensors
headers, and generation flags. The contract: each case is accepted (and then parses to a
usable value) or refused with one UsageError line, never another exception, within a time
limit, with the peak memory of the fuzzing process bounded. The command lines behind them
are checked the same way through real processes: exit 0, or exit 2 with one line and no
traceback.

Each family runs in a child process (``python tests/unit/test_fuzz.py FAMILY N SEED``) so
its peak RSS can be measured; the seeds are fixed, so a failure reproduces. In all about a
minute on this machine.
"""

from __future__ import annotations

import json
import os
import random
import resource
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if __name__ == "__main__":  # a child: make the checkout importable as in the tests
    sys.path.insert(0, str(ROOT))

from hpcmac.errors import UsageError  # noqa: E402

#: tokens a hostile user types where a number should be
HOSTILE = ["nan", "NaN", "inf", "-inf", "1e999", "-1", "0", "1e9", "4294967297",
           "99999999999999999999999", "١٢", "1_0", "0x10", "", " ", "\x00", "é", "\u2028",
           "2" * 400, "-0", "+", "1.5", "16.0", "3"]
CASE_LIMIT_S = 5.0  # any single case
PEAK_RSS_MB = 1500  # the fuzzing process, numpy and gguf included


def _one_line(exc: UsageError) -> None:
    msg = str(exc)
    assert msg and "\n" not in msg and "\r" not in msg, repr(msg)


def _run(case_fn, cases) -> tuple[int, int]:
    """Run every case; (accepted, refused). Anything but a UsageError propagates."""
    ok = refused = 0
    for case in cases:
        t0 = time.monotonic()
        try:
            case_fn(case)
            ok += 1
        except UsageError as exc:
            _one_line(exc)
            refused += 1
        took = time.monotonic() - t0
        assert took < CASE_LIMIT_S, f"case took {took:.1f} s: {case!r:.300}"
    return ok, refused


# ------------------------------------------------------------------ families (children)


def fuzz_hpl_dat(n: int, rng: random.Random) -> tuple[int, int]:
    from hpcmac.hpl import config

    base = config.DEFAULT_DAT.format(n=500, nb=64, p=1, q=2).split("\n")

    def cases():
        for _ in range(n):
            lines = list(base)
            for _ in range(rng.randint(1, 3)):
                k = rng.randrange(len(lines))
                toks = lines[k].split()
                action = rng.random()
                if action < 0.6 and toks:
                    toks[rng.randrange(len(toks))] = rng.choice(HOSTILE)
                    lines[k] = " ".join(toks)
                elif action < 0.8:
                    del lines[k]
                else:
                    lines.insert(k, rng.choice(HOSTILE))
            yield "\n".join(lines)

    def case(text):
        cfg = config.parse_hpl_dat(text, "f.dat")
        cfg = config.apply_overrides(cfg, 4)
        config.check_grids(cfg, 4)
        config.check_memory(cfg, 4, 1 << 30)
        assert cfg.threshold == cfg.threshold and all(n >= 0 for n in cfg.ns)  # no NaN
        for _ in zip(range(3), cfg.runs(4)):
            pass

    return _run(case, cases())


def _mutate_json(obj, rng: random.Random):
    """A copy of ``obj`` with one value somewhere replaced by something hostile."""
    hostile = [None, -1, 0, 1e308, 2**70, 10**18, "", "a\n", "x;rm -rf", [], {}, [[[]]],
               "10.77.1.1", "999.1.1.1", True, "é", 1.5, "a" * 300]
    if isinstance(obj, dict) and obj and rng.random() < 0.8:
        key = rng.choice(list(obj))
        out = dict(obj)
        if rng.random() < 0.2:
            del out[key]
        else:
            out[key] = _mutate_json(obj[key], rng)
        return out
    if isinstance(obj, list) and obj and rng.random() < 0.8:
        out = list(obj)
        k = rng.randrange(len(out))
        r = rng.random()
        if r < 0.15:
            del out[k]
        elif r < 0.3:
            out.append(out[k])
        else:
            out[k] = _mutate_json(out[k], rng)
        return out
    return rng.choice(hostile)


def fuzz_hostfiles(n: int, rng: random.Random) -> tuple[int, int]:
    import tempfile

    from hpcmac.launch import convert
    from hpcmac.launch.hostfile import load
    from hpcmac.launch.topology import rank_hosts, ring_order

    bases = [json.loads(p.read_text()) for p in sorted((ROOT / "hostfiles").glob("*.json"))]
    tmp = Path(tempfile.mkdtemp(prefix="fuzz-hf-"))
    path = tmp / "h.json"

    def cases():
        for _ in range(n):
            doc = rng.choice(bases)
            for _ in range(rng.randint(1, 3)):
                doc = _mutate_json(doc, rng)
            text = json.dumps(doc)
            if rng.random() < 0.2:  # byte-level damage too
                b = bytearray(text.encode())
                for _ in range(rng.randint(1, 4)):
                    b[rng.randrange(len(b))] = rng.randrange(256)
                yield bytes(b)
            else:
                yield text.encode()

    def case(data):
        path.write_bytes(data)
        hf = load(path)
        convert.openmpi_hostfile(hf)
        convert.mlx_hostfile(hf, None)
        rank_hosts(hf)
        ring_order(hf)

    try:
        return _run(case, cases())
    finally:
        path.unlink(missing_ok=True)
        tmp.rmdir()


def _tiny_gguf(path: Path) -> None:
    """A one-layer Llama GGUF with every tensor the loader needs (random, F32)."""
    import gguf
    import numpy as np

    h, v, ff, heads = 16, 32, 24, 2
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(h)
    w.add_feed_forward_length(ff)
    w.add_head_count(heads)
    w.add_head_count_kv(heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(v)
    r = np.random.default_rng(0)
    shapes = {"token_embd.weight": (v, h), "output_norm.weight": (h,), "output.weight": (v, h),
              "blk.0.attn_norm.weight": (h,), "blk.0.ffn_norm.weight": (h,),
              "blk.0.attn_q.weight": (h, h), "blk.0.attn_k.weight": (h, h),
              "blk.0.attn_v.weight": (h, h), "blk.0.attn_output.weight": (h, h),
              "blk.0.ffn_gate.weight": (ff, h), "blk.0.ffn_up.weight": (ff, h),
              "blk.0.ffn_down.weight": (h, ff)}
    for name, shape in shapes.items():
        w.add_tensor(name, r.standard_normal(shape).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def fuzz_gguf(n: int, rng: random.Random) -> tuple[int, int]:
    import tempfile

    from hpcmac.llm.model import gguf_loader
    from hpcmac.llm.model.stage import load_stage

    tmp = Path(tempfile.mkdtemp(prefix="fuzz-gguf-"))
    good = tmp / "good.gguf"
    _tiny_gguf(good)
    base = good.read_bytes()
    from hpcmac.plan.gguf_header import read_header

    header_end = read_header(good).size
    path = tmp / "m.gguf"

    def cases():
        for k in range(n):
            b = bytearray(base)
            if k % 3 == 0:  # a crafted 64-bit count or length somewhere in the header
                off = rng.randrange(8, header_end - 8)
                b[off:off + 8] = struct.pack("<Q", rng.choice(
                    [2**63, 2**40, 2**32 + 1, 10**9, 2**31, 0xFFFFFFFF, 7]))
            else:
                for _ in range(rng.randint(1, 6)):
                    b[rng.randrange(header_end)] = rng.randrange(256)
            if rng.random() < 0.1:
                b = b[:rng.randrange(len(b))]
            yield bytes(b)

    def case(data):
        path.write_bytes(data)
        gguf_loader._READERS.clear()
        ck = gguf_loader.GGUFCheckpoint(path)
        cfg = ck.config()
        load_stage(path, 0, cfg.n_layers, first=True, last=True)

    try:
        assert _run(case, [base])[0] == 1  # the unmutated file loads
        return _run(case, cases())
    finally:
        for p in tmp.iterdir():
            p.unlink()
        tmp.rmdir()


def _safetensors_bytes(tensors: dict) -> tuple[bytes, bytes]:
    import numpy as np

    table, data, off = {}, b"", 0
    for name, arr in tensors.items():
        raw = np.ascontiguousarray(arr, dtype=np.float32).tobytes()
        table[name] = {"dtype": "F32", "shape": list(arr.shape),
                       "data_offsets": [off, off + len(raw)]}
        data += raw
        off += len(raw)
    return json.dumps(table).encode(), data


def fuzz_safetensors(n: int, rng: random.Random) -> tuple[int, int]:
    import tempfile

    import numpy as np

    from hpcmac.llm.model.weights import SafetensorsCheckpoint

    head, data = _safetensors_bytes({"a.weight": np.ones((4, 3)), "b.bias": np.arange(5.0)})
    table = json.loads(head)
    tmp = Path(tempfile.mkdtemp(prefix="fuzz-st-"))
    path = tmp / "model.safetensors"

    def cases():
        for _ in range(n):
            if rng.random() < 0.7:
                h = json.dumps(_mutate_json(table, rng)).encode()
            else:
                b = bytearray(head)
                for _ in range(rng.randint(1, 4)):
                    b[rng.randrange(len(b))] = rng.randrange(256)
                h = bytes(b)
            declared = len(h) if rng.random() < 0.9 else rng.choice([0, 2**63, len(h) + 7])
            yield struct.pack("<Q", declared) + h + data

    def case(blob):
        path.write_bytes(blob)
        ck = SafetensorsCheckpoint(tmp)
        for name in ck.names():
            arr = ck.get(name)
            assert arr.dtype == np.float32

    try:
        return _run(case, cases())
    finally:
        for p in tmp.iterdir():
            p.unlink()
        tmp.rmdir()


def fuzz_flags(n: int, rng: random.Random) -> tuple[int, int]:
    import types

    from hpcmac.llm.cli import build_parser, check_arguments, context_length

    flags = ["--max-tokens", "--temperature", "--top-k", "--top-p", "--repetition-penalty",
             "--seed", "--max-context", "--micro-batches", "--max-batch", "--prefill-chunk",
             "--timeout", "--threads", "--q-group-size", "--quantize"]
    cfg = types.SimpleNamespace(max_position=2048)

    def cases():
        for _ in range(n):
            argv = ["generate", "--model", "m", "--prompt-ids", "1,2"]
            for _ in range(rng.randint(1, 4)):
                argv += [rng.choice(flags), rng.choice(HOSTILE)]
            yield argv

    def case(argv):
        args = build_parser().parse_args(argv)
        sampling = check_arguments(args)
        n_ctx = context_length(args, cfg)
        assert 1 <= n_ctx <= cfg.max_position
        for v in (sampling.temperature, sampling.top_p, sampling.repetition_penalty):
            assert v == v and abs(v) != float("inf")

    return _run(case, cases())


FAMILIES = {"hpl_dat": (fuzz_hpl_dat, 3000), "hostfiles": (fuzz_hostfiles, 1500),
            "gguf": (fuzz_gguf, 1000), "safetensors": (fuzz_safetensors, 1500),
            "flags": (fuzz_flags, 2000)}


# ------------------------------------------------------------------ the tests (parent)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_fuzz_family(family):
    """One family in a child process: contract held for every case, time and peak RSS bound."""
    n = FAMILIES[family][1]
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, __file__, family, str(n), "19"],
                          capture_output=True, text=True, timeout=200,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)))
    took = time.monotonic() - t0
    peak_mb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ok, refused = map(int, proc.stdout.split()[-2:])
    print(f"{family}: {n} cases, {ok} accepted, {refused} refused, {took:.1f} s")
    assert ok + refused == n and refused > 0
    # ru_maxrss of children is the largest child so far: only meaningful when it grew
    assert peak_mb < PEAK_RSS_MB or before / 1024 >= PEAK_RSS_MB, f"peak RSS {peak_mb:.0f} MB"


def _cli(args, cwd, timeout=120):
    env = dict(os.environ, PYTHONPATH=str(ROOT), HPCMAC_QUIET_TRANSPORT="1")
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True,
                          timeout=timeout)
    return proc, time.monotonic() - t0


@pytest.mark.timeout(240)
def test_command_lines_refuse_with_one_line(tmp_path):
    """Hostile inputs through the real commands: exit 2, one line on stderr, no traceback."""
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "deep.json").write_text("[" * 100000 + "]" * 100000)
    (tmp_path / "bad.txt").write_bytes(b"hello\n\xff\xfe\n")
    cases = [
        ["-m", "hpcmac.hpl", "--dat", "fifo"],
        ["-m", "hpcmac.hpl", "-N", "nan"],
        ["-m", "hpcmac.hpl", "-N", "100", "-P", "١"],
        ["-m", "hpcmac.launch", "check", "--hostfile", "deep.json"],
        ["-m", "hpcmac.launch", "check", "--hostfile", "/dev/zero"],
        ["-m", "hpcmac.launch", "check", "--hostfile", "bad.txt"],
        ["-m", "hpcmac.llm", "generate", "--model", "smollm2", "--prompt", "hi",
         "--temperature", "nan"],
        ["-m", "hpcmac.llm", "generate", "--model", "smollm2", "--prompt-ids", "1",
         "--max-context", "0"],
        ["-m", "hpcmac.llm", "generate", "--model", "smollm2", "--batch", "fifo"],
        ["-m", "hpcmac.llm", "generate", "--model", "smollm2", "--batch", "bad.txt"],
        ["-m", "hpcmac.llm", "generate", "--model", "smollm2", "--prompt", "hi",
         "--json", str(tmp_path)],
    ]
    for args in cases:
        proc, took = _cli(args, tmp_path)
        err = proc.stderr.decode(errors="replace")
        lines = [ln for ln in err.splitlines() if ln.strip()]
        assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in err, (args, err)
        # the LLM cases read SmolLM2's GGUF header first: seconds, more on a loaded machine;
        # the bound is there to catch a hang, not to time the model load
        assert lines[0].startswith("error: ") and took < 120, (args, lines, took)


if __name__ == "__main__":
    family, count, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    accepted, refused_ = FAMILIES[family][0](count, random.Random(seed))
    print(accepted, refused_)
