"""``python -m hpcmac.bench.llm``: decode speed against the memory-bandwidth bound and llama.cpp.

Measured in one run, in interleaved rounds (medians reported), with the same
number of BLAS / llama.cpp threads:

* the machine's read bandwidth (BLAS ``sdot`` over two arrays far larger than cache),
* single-sequence decode tok/s, against the bound ``bandwidth / weight bytes per token``,
* batched decode of ``--batch`` sequences (aggregate tok/s) against the single rate,
* llama.cpp (``xllamacpp`` wheel, if installed) on the same weights as an F32 GGUF,
  and with ``--llamacpp-native VENV`` also a llama.cpp built for this CPU (the
  wheel runs AVX2 kernels only): llama-cpp-python installed from source into VENV,
  run there in a subprocess on the same GGUFs (see docs/llm.md for the build),
* quantized rows (``--quant Q8_0,Q4_0,MXFP4,FP8``): the same model written as a GGUF of
  each type, decoded by hpcmac with the codes kept quantized, by hpcmac on the same
  weights dequantized to float32, and by llama.cpp on that GGUF, against the
  bandwidth bound of the quantized bytes; and the memory held against the file.
  ``FP8`` is no GGUF type: the same weights as a Qwen3 safetensors folder quantized as
  the FP8 releases are (e4m3, 128 x 128 block scales; Qwen3-FP8's own form, with unit
  Q/K norms so the layers compute what the Llama's do), no llama.cpp row (llama.cpp has
  no such type).

``--contexts 64,4096`` adds single-sequence decode rows after prompts of those lengths
(the first is the reference): a linear-attention model's state does not grow with them.
``--family qwen3_next`` makes the random model a dense Qwen3-Next of the same sizes
(Gated DeltaNet in 3 of 4 layers, heads of 128; written by transformers, so it needs
torch), for that row; llama.cpp and the quantized rows are the Llama's only.

``--ttft`` measures instead the time to first token from a fresh process beside
llama.cpp's (hpcmac.bench.llm_ttft); ``--rows 1,2,4,16,32`` the model's quantized
products at those activation rows, kernel against dequantized tiles
(hpcmac.bench.llm_rows).

By default the model is a random float32 Llama of ~150M parameters (~490 MB read
per token) written to a temporary folder; ``--model`` benchmarks any checkpoint (its
rows: bandwidth, decode, batched, contexts).
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from importlib.util import find_spec
from pathlib import Path

import numpy as np

from hpcmac.errors import ArgumentParser, UsageError
from hpcmac.io.outputs import checked_output
from hpcmac.lifecycle import run_cli
from hpcmac.measure.llm import decode_rate, read_bandwidth, write_random_llama


def llamacpp_rate(gguf_path: Path, threads: int, steps: int, vocab: int) -> float | None:
    """llama.cpp decode tok/s on the same weights (None if xllamacpp is not installed)."""
    try:
        import xllamacpp as xlc
    except ImportError:
        return None
    p = xlc.CommonParams()
    p.model.path = str(gguf_path)
    p.n_ctx = 256
    p.cpuparams.n_threads = threads
    p.cpuparams_batch.n_threads = threads
    server = xlc.Server(p)
    prompt = [int(x) for x in np.random.default_rng(1).integers(0, vocab, 16)]
    rates = []
    for _ in range(2):  # the first request warms up
        res = server.handle_completions({"prompt": prompt, "max_tokens": steps, "n_predict": steps,
                                         "temperature": 0, "ignore_eos": True,
                                         "cache_prompt": False})
        rates.append(res["timings"]["predicted_per_second"])
    del server
    return rates[-1]


#: what the native llama.cpp's subprocess runs (in --llamacpp-native's Python): load the
#: GGUF, prefill 16 random tokens, then time ``steps`` one-token decode steps, greedy (the
#: logits read and argmax'd as hpcmac's decode_rate does), twice (the first warms up);
#: prints the rate of the median step, as decode_rate's, and the build's CPU features as
#: one JSON line
_NATIVE = """
import json, statistics, sys, time
import numpy as np
import llama_cpp
path, threads, steps, vocab = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
llm = llama_cpp.Llama(model_path=path, n_ctx=256, n_threads=threads, n_threads_batch=threads,
                      verbose=False)
prompt = [int(x) for x in np.random.default_rng(1).integers(0, vocab, 16)]
for _ in range(2):
    llm.reset()
    llm.eval(prompt)
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        llm.eval([int(np.argmax(llm.scores[llm.n_tokens - 1]))])
        times.append(time.perf_counter() - t)
print(json.dumps({"rate": 1.0 / statistics.median(times),
                  "system": llama_cpp.llama_print_system_info().decode()}))
"""


def native_python(venv: str) -> str:
    """``--llamacpp-native``'s interpreter: VENV/bin/python, which must import llama_cpp;
    one line otherwise."""
    py = Path(venv) / "bin" / "python"
    if not py.is_file():
        raise UsageError(f"--llamacpp-native {venv}: no {py} (expected a Python venv with "
                         "llama-cpp-python built from source; see docs/llm.md)")
    r = subprocess.run([str(py), "-c", "import llama_cpp"], capture_output=True, text=True)
    if r.returncode:
        raise UsageError(f"--llamacpp-native {venv}: its Python cannot import llama_cpp "
                         "(expected llama-cpp-python installed there; see docs/llm.md)")
    return str(py)


def native_rate(python: str, gguf_path: Path, threads: int, steps: int, vocab: int
                ) -> tuple[float | None, str]:
    """(decode tok/s, the build's CPU features) of the native llama.cpp on ``gguf_path``,
    or (None, why it failed): a build can crash on one type and run the others (this
    VM's AMX build segfaulted on quantized models), so the bench goes on and says so."""
    import signal

    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    try:
        r = subprocess.run([python, "-c", _NATIVE, str(gguf_path), str(threads), str(steps),
                            str(vocab)], capture_output=True, text=True, env=env,
                           timeout=1800)
    except subprocess.TimeoutExpired:
        return None, f"{gguf_path.name}: no result in 1800 s"
    if r.returncode:
        if r.returncode < 0:
            with contextlib.suppress(ValueError):
                return None, f"{gguf_path.name}: killed by {signal.Signals(-r.returncode).name}"
        tail = (r.stderr.strip().splitlines() or ["(no output)"])[-1]
        return None, f"{gguf_path.name}: exit {r.returncode}: {tail}"
    try:
        out = json.loads(r.stdout.strip().splitlines()[-1])
        return float(out["rate"]), str(out["system"])
    except (IndexError, ValueError, KeyError, TypeError):
        return None, f"{gguf_path.name}: no rate in its output {r.stdout.strip()[-200:]!r}"


#: the GGUF types the gguf package's writer quantizes (the quantized rows' files), and FP8
#: (a safetensors folder, see the module docstring)
QUANT_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "MXFP4", "FP8")
#: the types whose codes the 8-bit-activation kernels take (the others multiply float32)
INT8_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")


def write_fp8_qwen3(llama: Path, out: Path) -> Path:
    """The random Llama ``llama`` as an FP8 Qwen3 folder (see the module docstring)."""
    from safetensors.numpy import load_file, save_file

    from hpcmac.llm.model.fixtures import fp8_checkpoint

    cfg = json.loads((llama / "config.json").read_text())
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    tensors = load_file(str(llama / "model.safetensors"))
    for i in range(cfg["num_hidden_layers"]):
        for n in ("q_norm", "k_norm"):
            tensors[f"model.layers.{i}.self_attn.{n}.weight"] = np.ones(head_dim, np.float32)
    src = out.parent / (out.name + "-src")
    src.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(src / "model.safetensors"))
    del tensors
    (src / "config.json").write_text(json.dumps(
        {**cfg, "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"],
         "head_dim": head_dim, "attention_bias": False}))
    fp8_checkpoint(src, out)
    import shutil

    shutil.rmtree(src, ignore_errors=True)
    return out


#: the families the random model can be (``--family``)
FAMILIES = ("llama", "qwen3_next")


def write_random_qwen3_next(folder: Path, hidden: int, layers: int, intermediate: int,
                            vocab: int, positions: int) -> Path:
    """A random dense float32 Qwen3-Next (transformers' own model, saved): Gated DeltaNet
    in 3 of every 4 layers with hidden/128 key and 2x as many value heads of 128, the
    others gated full attention of hidden/128 query and hidden/512 KV heads of 128."""
    from hpcmac.llm.model.fixtures import random_checkpoint

    heads = max(1, hidden // 128)
    return random_checkpoint(
        "qwen3_next", folder, hidden_size=hidden, num_hidden_layers=layers,
        intermediate_size=intermediate, vocab_size=vocab, num_attention_heads=heads,
        num_key_value_heads=max(1, hidden // 512), head_dim=128, linear_num_key_heads=heads,
        linear_num_value_heads=2 * heads, linear_key_head_dim=128, linear_value_head_dim=128,
        num_experts=0, max_position_embeddings=positions)


def quant_types(text: str) -> list[str]:
    """``--quant``'s comma-separated GGUF types, upper-cased; one clear line for a type
    this benchmark cannot write."""
    out = [q.strip().upper() for q in text.split(",") if q.strip()]
    for q in out:
        if q not in QUANT_TYPES:
            raise UsageError(f"--quant: {q!r} is not a GGUF type this benchmark can write "
                             f"(one of {', '.join(QUANT_TYPES)}, comma-separated; '' for none)")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = ArgumentParser(prog="python -m hpcmac.bench.llm",
                        description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="checkpoint (default: a random float32 Llama)")
    ap.add_argument("--family", default="llama", choices=FAMILIES,
                    help="the random model's family (qwen3_next: for --contexts; needs torch)")
    ap.add_argument("--workdir", default=None, help="where the random model and GGUF go")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--intermediate", type=int, default=2816)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--threads", type=int, default=1, help="BLAS and llama.cpp threads")
    ap.add_argument("--steps", type=int, default=32, help="decode steps per measurement")
    ap.add_argument("--batch", type=int, default=4, help="sequences in the batched run")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--backend", default="numpy")
    ap.add_argument("--no-llamacpp", action="store_true")
    ap.add_argument("--llamacpp-native", default=None, metavar="VENV",
                    help="also run llama.cpp built for this CPU: a Python venv with "
                         "llama-cpp-python installed from source (docs/llm.md), on the same "
                         "GGUFs (random model only)")
    ap.add_argument("--quant", default="Q8_0,Q4_0,MXFP4,FP8",
                    help="GGUF types for the quantized rows, comma-separated ('' = none; "
                         "random model only)")
    ap.add_argument("--contexts", default="", metavar="N,N",
                    help="also decode 1 sequence after prompts of these lengths (the first "
                         "is the reference), e.g. 64,4096")
    ap.add_argument("--json", type=checked_output("--json"), default=None, metavar="FILE")
    ap.add_argument("--ttft", action="store_true",
                    help="time to first token from a fresh process against llama.cpp, same "
                         "GGUF and prompt, 1 thread (--model: a GGUF, default smollm2; see "
                         "hpcmac.bench.llm_ttft)")
    ap.add_argument("--rows", default=None, metavar="N,N",
                    help="instead: the quantized products of the model (--model, default "
                         "smollm2) at these activation rows, kernel against dequantized "
                         "tiles and BLAS (hpcmac.bench.llm_rows), e.g. 1,2,4,16,32")
    ap.add_argument("--prompt-words", type=int, default=256,
                    help="--ttft: words in the prompt (about one token each; default 256)")
    ap.add_argument("--timeout", type=float, default=300.0,
                    help="--ttft: seconds one process may take (default 300)")
    args = ap.parse_args(argv)
    if args.ttft:
        if args.rounds < 1 or args.prompt_words < 1:
            raise UsageError("--rounds and --prompt-words must be >= 1")
        from hpcmac.bench.llm_ttft import run as ttft

        return ttft(args.model, args.prompt_words, args.rounds, args.timeout, args.json)
    if args.rows is not None:
        if args.rounds < 1:
            raise UsageError("--rounds must be >= 1")
        from hpcmac.bench.llm_rows import parse_rows
        from hpcmac.bench.llm_rows import run as rows

        return rows(args.model, parse_rows(args.rows), args.rounds, args.json)
    if args.threads < 1 or args.steps < 1 or args.batch < 1 or args.rounds < 1:
        raise UsageError("--threads, --steps, --batch and --rounds must be >= 1")
    args.quant = ",".join(quant_types(args.quant))
    contexts = [c.strip() for c in args.contexts.split(",") if c.strip()]
    if any(not c.isdigit() or int(c) < 1 for c in contexts):
        raise UsageError(f"--contexts {args.contexts!r}: expected prompt lengths >= 1, "
                         "comma-separated (e.g. 64,4096)")
    contexts = [int(c) for c in contexts]
    llama = args.model is None and args.family == "llama"  # llama.cpp and --quant rows
    if args.model is None and args.family != "llama" and (
            find_spec("torch") is None or find_spec("transformers") is None):
        raise UsageError(f"--family {args.family}: the random model is written by "
                         "transformers (torch and transformers are not installed)")
    native = None
    if args.llamacpp_native and not args.no_llamacpp and llama:
        native = native_python(args.llamacpp_native)
    from threadpoolctl import threadpool_limits

    from hpcmac.llm.model.stage import load_stage

    tmp = None
    if args.workdir:
        work = Path(args.workdir)
    else:
        work = Path(tmp := tempfile.mkdtemp(prefix="hpcmac-llm-"))
    model = args.model
    if model is None and args.family == "qwen3_next":
        model = write_random_qwen3_next(work / "qwen3-next", args.hidden, args.layers,
                                        args.intermediate, args.vocab,
                                        max([16, *contexts]) + args.steps + 1)
    elif model is None:
        model = write_random_llama(work / "llama", args.hidden, args.layers, args.intermediate,
                                   args.vocab, heads=args.hidden // 64,
                                   kv_heads=max(1, args.hidden // 256))
    stage = load_stage(model, 0, _n_layers(model), True, True, backend=args.backend)
    cfg = stage.config
    per_token = stage.nbytes - cfg.vocab * cfg.hidden * 4 * (0 if cfg.tie_embeddings else 1)
    gguf_path = None
    if not args.no_llamacpp and llama and (native or find_spec("xllamacpp")):
        from hpcmac.llm.model.fixtures import write_gguf

        gguf_path = write_gguf(model, work / "llama-f32.gguf", "F32")
    system = ""
    native_failed: dict[str, list[str]] = {}  # type -> why, each round it gave no rate
    qtypes = [q for q in args.quant.split(",") if q] if llama else []
    if "FP8" in qtypes and find_spec("torch") is None:  # its e4m3 rounding is torch's
        qtypes.remove("FP8")
        print("FP8 row: not run (it writes the FP8 copy with torch, not installed)")
    quant = {}
    for qt in qtypes:
        from hpcmac.llm.model.fixtures import write_gguf

        path = write_fp8_qwen3(model, work / "qwen3-fp8") if qt == "FP8" else \
            write_gguf(model, work / f"llama-{qt}.gguf", qt)
        rss = _load_rss(path, cfg.n_layers, args.backend)
        kept = load_stage(path, 0, cfg.n_layers, True, True, backend=args.backend)
        file_bytes = path.stat().st_size if path.is_file() else \
            sum(f.stat().st_size for f in path.glob("*.safetensors"))
        from hpcmac.llm.model.weights import open_checkpoint

        # read per token: every held byte but the embedding table's (only a row is read)
        embed = open_checkpoint(path).stored_nbytes("model.embed_tokens.weight")
        quant[qt] = {"path": path, "kept": kept, "file_bytes": file_bytes,
                     "per_token": kept.nbytes - (0 if cfg.tie_embeddings else embed),
                     "held_bytes": kept.nbytes, "rss": rss,
                     "float": load_stage(path, 0, cfg.n_layers, True, True,
                                         backend=args.backend, keep_quantized=False)}
    rounds = []
    host: dict = {}  # the one-sequence decode's host syncs and bytes per token (MLX: 1, 4)
    with threadpool_limits(args.threads):
        for _ in range(args.rounds):
            r = {"bandwidth": read_bandwidth(),
                 "single": decode_rate(stage, 1, args.steps, counts=host),
                 "batched": decode_rate(stage, args.batch, args.steps)}
            for n in contexts:
                r[f"ctx{n}"] = decode_rate(stage, 1, args.steps, prompt_len=n)
            if gguf_path is not None:
                with _quiet_stderr():  # llama.cpp logs every load to fd 2
                    lc = llamacpp_rate(gguf_path, args.threads, args.steps, cfg.vocab)
                if lc:
                    r["llamacpp"] = lc
                if native:
                    rate, what = native_rate(native, gguf_path, args.threads, args.steps,
                                             cfg.vocab)
                    if rate is None:
                        native_failed.setdefault("F32", []).append(what)
                    else:
                        r["native"], system = rate, what
            for qt, q in quant.items():
                r[f"{qt}_kept"] = decode_rate(q["kept"], 1, args.steps)
                if args.backend == "numpy" and qt in INT8_TYPES:  # 8-bit activations
                    q["kept"].backend.int8 = True
                    r[f"{qt}_i8"] = decode_rate(q["kept"], 1, args.steps)
                    q["kept"].backend.int8 = False
                r[f"{qt}_float"] = decode_rate(q["float"], 1, args.steps)
                if not args.no_llamacpp and qt != "FP8":
                    with _quiet_stderr():
                        lc = llamacpp_rate(q["path"], args.threads, args.steps, cfg.vocab)
                    if lc:
                        r[f"{qt}_llamacpp"] = lc
                    if native:
                        rate, what = native_rate(native, q["path"], args.threads,
                                                 args.steps, cfg.vocab)
                        if rate is None:
                            native_failed.setdefault(qt, []).append(what)
                        else:
                            r[f"{qt}_native"], system = rate, system or what
            rounds.append(r)
    for r in rounds:  # ratios within a round: the load of a shared machine shifts between rounds
        r["single_vs_bound"] = r["single"] * per_token / r["bandwidth"]
        r["batched_vs_single"] = r["batched"] / r["single"]
        for n in contexts:
            r[f"ctx{n}_vs_ctx{contexts[0]}"] = r[f"ctx{n}"] / r[f"ctx{contexts[0]}"]
        if r.get("llamacpp"):
            r["vs_llamacpp"] = r["single"] / r["llamacpp"]
        if r.get("native"):
            r["vs_native"] = r["single"] / r["native"]
        for qt in quant:
            r[f"{qt}_vs_float"] = r[f"{qt}_kept"] / r[f"{qt}_float"]
            if f"{qt}_i8" in r:
                r[f"{qt}_i8_vs_float"] = r[f"{qt}_i8"] / r[f"{qt}_float"]
            if f"{qt}_native" in r:
                r[f"{qt}_vs_native"] = r[f"{qt}_kept"] / r[f"{qt}_native"]
                if f"{qt}_i8" in r:
                    r[f"{qt}_i8_vs_native"] = r[f"{qt}_i8"] / r[f"{qt}_native"]
            if f"{qt}_llamacpp" in r:
                r[f"{qt}_vs_llamacpp"] = r[f"{qt}_kept"] / r[f"{qt}_llamacpp"]
                if f"{qt}_i8" in r:
                    r[f"{qt}_i8_vs_llamacpp"] = r[f"{qt}_i8"] / r[f"{qt}_llamacpp"]
    keys = dict.fromkeys(k for r in rounds for k in r)  # a native row can fail in a round
    med = {k: statistics.median(r[k] for r in rounds if k in r) for k in keys}
    bound = med["bandwidth"] / per_token
    print(f"hpcmac.bench.llm: {platform.processor() or platform.machine()}, {os.cpu_count()} "
          f"cores, {args.threads} thread(s), backend {args.backend}; medians of {args.rounds} "
          "rounds; ratios are medians of per-round ratios (a shared machine's load shifts)")
    print(f"model: {cfg.arch}, {cfg.n_layers} layers, hidden {cfg.hidden}, "
          f"{stage.nbytes / 1e6:.0f} MB float32, {per_token / 1e6:.0f} MB read per token")
    rows = [("read bandwidth (sdot)", f"{med['bandwidth'] / 1e9:.1f} GB/s", "", ""),
            ("decode, 1 sequence", f"{med['single']:.1f} tok/s", f"bound {bound:.1f} tok/s",
             f"{med['single_vs_bound']:.2f}"),
            (f"decode, {args.batch} sequences", f"{med['batched']:.1f} tok/s",
             f"1 seq {med['single']:.1f} tok/s", f"{med['batched_vs_single']:.2f}")]
    for n in contexts:
        rows.append((f"decode after {n} tokens", f"{med[f'ctx{n}']:.1f} tok/s",
                     f"after {contexts[0]}: {med[f'ctx{contexts[0]}']:.1f} tok/s",
                     f"{med[f'ctx{n}_vs_ctx{contexts[0]}']:.2f}"))
    if "vs_llamacpp" in med:
        rows.append(("llama.cpp F32, 1 sequence", f"{med['llamacpp']:.1f} tok/s",
                     f"hpcmac {med['single']:.1f} tok/s", f"{med['vs_llamacpp']:.2f}"))
    else:
        rows.append(("llama.cpp", "not run", "no xllamacpp, --model or --family", ""))
    if "vs_native" in med:
        rows.append(("llama.cpp native F32", f"{med['native']:.1f} tok/s",
                     f"hpcmac {med['single']:.1f} tok/s", f"{med['vs_native']:.2f}"))
    for qt, q in quant.items():
        held = q["held_bytes"]
        qbound = med["bandwidth"] / q["per_token"]
        rows.append((f"{qt}: memory held", f"{held / 1e6:.0f} MB",
                     f"file {q['file_bytes'] / 1e6:.0f} MB", f"{held / q['file_bytes']:.2f}"))
        rss = q["rss"]
        if rss:
            rows.append((f"{qt}: RSS gained by load", f"{rss['load'] / 1e6:.0f} MB",
                         f"file {q['file_bytes'] / 1e6:.0f} MB",
                         f"{rss['load'] / q['file_bytes']:.2f}"))
            rows.append((f"{qt}: RSS absolute", f"{rss['after_load'] / 1e6:.0f} MB",
                         f"imports {rss['base'] / 1e6:.0f}, +1st step "
                         f"{rss['step'] / 1e6:.0f}", ""))
        rows.append((f"{qt}: decode, kept", f"{med[qt + '_kept']:.1f} tok/s",
                     f"bound {qbound:.1f} tok/s", f"{med[qt + '_kept'] / qbound:.2f}"))
        rows.append((f"{qt}: vs float32 path", f"{med[qt + '_kept']:.1f} tok/s",
                     f"float32 {med[qt + '_float']:.1f} tok/s", f"{med[qt + '_vs_float']:.2f}"))
        if qt + "_vs_llamacpp" in med:
            rows.append((f"{qt}: vs llama.cpp", f"{med[qt + '_kept']:.1f} tok/s",
                         f"llama.cpp {med[qt + '_llamacpp']:.1f} tok/s",
                         f"{med[qt + '_vs_llamacpp']:.2f}"))
        if qt + "_vs_native" in med:
            rows.append((f"{qt}: vs llama.cpp native", f"{med[qt + '_kept']:.1f} tok/s",
                         f"native {med[qt + '_native']:.1f} tok/s",
                         f"{med[qt + '_vs_native']:.2f}"))
        if qt + "_i8" in med:
            rows.append((f"{qt}: int8 act. vs float32", f"{med[qt + '_i8']:.1f} tok/s",
                         f"float32 {med[qt + '_float']:.1f} tok/s",
                         f"{med[qt + '_i8_vs_float']:.2f}"))
        if qt + "_i8_vs_llamacpp" in med:
            rows.append((f"{qt}: int8 act. vs llama.cpp", f"{med[qt + '_i8']:.1f} tok/s",
                         f"llama.cpp {med[qt + '_llamacpp']:.1f} tok/s",
                         f"{med[qt + '_i8_vs_llamacpp']:.2f}"))
        if qt + "_i8_vs_native" in med:
            rows.append((f"{qt}: int8 act. vs native", f"{med[qt + '_i8']:.1f} tok/s",
                         f"native {med[qt + '_native']:.1f} tok/s",
                         f"{med[qt + '_i8_vs_native']:.2f}"))
    if system:
        print(f"llama.cpp native ({args.llamacpp_native}): {system.strip()}")
    for qt, why in native_failed.items():  # its rows (if any) are the other rounds' medians
        print(f"llama.cpp native {qt}: failed in {len(why)} of {args.rounds} rounds "
              f"(last: {why[-1]})")
    print(f"{'measure':<28}{'value':>14}  {'reference':<28}{'ratio':>6}")
    for name, val, ref, ratio in rows:
        print(f"{name:<28}{val:>14}  {ref:<28}{ratio:>6}")
    if args.json:
        out = {"threads": args.threads, "backend": args.backend, "weight_bytes": stage.nbytes,
               "bytes_per_token": per_token, "rounds": rounds, "median": med,
               "bound_tok_s": bound, "single_vs_bound": med["single_vs_bound"],
               "batched_vs_single": med["batched_vs_single"],
               "vs_llamacpp": med.get("vs_llamacpp"), "vs_native": med.get("vs_native"),
               "native_system": system or None, "native_failed": native_failed,
               "host": [{"rank": 0, **host}],  # one sequence's decode, counted by the backend
               "quantized": {qt: {"file_bytes": q["file_bytes"], "held_bytes": q["held_bytes"],
                                  "rss": q["rss"]} for qt, q in quant.items()}}
        from hpcmac.io.outputs import write_atomic

        write_atomic(args.json, json.dumps(out, indent=1), what="--json")
    if tmp is not None:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return 0


@contextlib.contextmanager
def _quiet_stderr():
    sys.stderr.flush()
    saved = os.dup(2)
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(null)
        os.close(saved)


def _load_rss(path: Path, n_layers: int, backend: str) -> dict | None:
    """Resident bytes of a fresh process that loads the whole model as ``generate`` does
    (load, then drop the GGUF reader's parsed metadata): ``base`` after the imports
    (numpy, hpcmac, numba and LLVM), ``after_load``, ``load`` = the difference (what
    the target is judged on: the model's own memory, not the interpreter's), and
    ``step`` = what the first decode step adds (compiled kernels, LLVM's state)."""
    code = ("import sys, json; from hpcmac.bench.llm import _rss; "
            "from hpcmac.measure.llm import decode_rate; "
            "from hpcmac.llm.model.stage import load_stage; "
            "from hpcmac.llm.model.gguf_loader import forget_readers; import numba; "
            "r0 = _rss(); "
            f"s = load_stage(sys.argv[1], 0, {n_layers}, True, True, backend={backend!r}); "
            "forget_readers(); r1 = _rss(); decode_rate(s, 1, 1); r2 = _rss(); "
            "print(json.dumps(dict(base=r0, after_load=r1, load=r1 - r0, step=r2 - r1)))")
    r = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True,
                       text=True, timeout=600)
    if r.returncode or not r.stdout.strip():
        return None
    return json.loads(r.stdout.strip().splitlines()[-1])


def _rss() -> int:
    """Resident bytes of this process now (Linux /proc; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return 0


def _n_layers(model) -> int:
    from hpcmac.llm.model.config import load_config

    return load_config(model).n_layers


if __name__ == "__main__":
    sys.exit(run_cli(main))
