"""``python -m hpcmac.plan``: predict HPL and LLM decoding on a cluster before building it.

Commands::

    python -m hpcmac.plan hpl  --machine m3-ultra --nodes 1,2,4 --link 2.5gbe,tb5-rdma
    python -m hpcmac.plan hpl  --hostfile cluster.json -N 200000 --nb 256 -P 2 -Q 2
    python -m hpcmac.plan llm  MODEL --machine m3-ultra --nodes 1,2,4 --link tb5-rdma
    python -m hpcmac.plan calibrate --json node.json
    python -m hpcmac.plan machines

A cluster is ``--machine NAME --nodes K --link NAME`` (lists of nodes and
links give a scaling table), or ``--hostfile FILE`` (hosts with ``machine``,
``memory_gb``, ``slots``; a top-level ``"link"``). ``--calibration FILE``
(from ``calibrate``) replaces the table's figures by this node's measured
ones; ``--comm FILE`` (from ``python -m hpcmac.bench.comm --json``) the
link's. No MPI is started; nothing is loaded but headers.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from hpcmac.errors import ArgumentParser, UsageError
from hpcmac.io.outputs import checked_output
from hpcmac.lifecycle import run_cli
from hpcmac.plan import cluster as clmod
from hpcmac.plan import hpl as hplmod
from hpcmac.plan import machines as mc


def _ints(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected integers separated by commas, got {text!r}") from None
    if not out:
        raise argparse.ArgumentTypeError(f"expected at least one integer, got {text!r}")
    return out


def _floats(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected numbers separated by commas, got {text!r}") from None


def _names(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def _cluster_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("cluster")
    g.add_argument("--machine", help=f"node type: {', '.join(mc.MACHINES)}")
    g.add_argument("--nodes", type=_ints, default=[1], help="node count(s), e.g. 1,2,4")
    g.add_argument("--link", type=_names, default=None,
                   help=f"link type(s) between nodes: {', '.join(mc.LINKS)}")
    g.add_argument("--memory-gb", type=_floats, default=None,
                   help="memory per node (one value, or one per node)")
    g.add_argument("--slots", type=int, default=1, help="ranks per node (default 1)")
    g.add_argument("--hostfile", help="hpcmac hostfile (hosts with machine/memory_gb/slots)")
    g.add_argument("--calibration", metavar="FILE",
                   help="node figures measured by 'python -m hpcmac.plan calibrate --json'")
    g.add_argument("--comm", metavar="FILE",
                   help="link figures measured by 'python -m hpcmac.bench.comm --json'")
    g.add_argument("--blas-threads", type=int, default=None,
                   help="BLAS threads per rank (default: the node's cores split by its ranks)")


def _output_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", type=checked_output("--json"),
                   metavar="FILE", help="also write the results as JSON ('-': stdout)")
    p.add_argument("--plot", metavar="PNG", help="plot the scaling table (needs matplotlib)")


def clusters(args) -> list[tuple[str, int, clmod.Cluster]]:
    """(link name, nodes, cluster) for every combination the flags ask for."""
    links = args.link or [None]
    out = []
    for lk in links:
        for k in (args.nodes if not args.hostfile else [None]):
            cl = clmod.build(machine=args.machine, nodes=k or 1, link=lk,
                             memory_gb=args.memory_gb, slots=args.slots, hostfile=args.hostfile,
                             calibration=args.calibration, comm=args.comm,
                             blas_threads=args.blas_threads)
            out.append((cl.link.name, len(cl.nodes), cl))
    return out


def _emit(args, records: list[dict], lines: list[str]) -> None:
    if args.json == "-":
        json.dump(records, sys.stdout, indent=1)
        print()
    else:
        print("\n".join(lines))
        if args.json:
            from hpcmac.io.outputs import write_atomic

            write_atomic(args.json, json.dumps(records, indent=1), what="--json")
            print(f"wrote {args.json}", file=sys.stderr)


def plot(path: str, records: list[dict], ykey: str, ylabel: str, title: str) -> None:
    """Predicted ``ykey`` against node count, one line per link (and layout)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UsageError("--plot needs matplotlib: pip install 'hpcmac[plot]'") from None
    series: dict[str, list[tuple[int, float]]] = {}
    for r in records:
        label = r["link"] + (f" {r['layout']}" if "layout" in r else "")
        series.setdefault(label, []).append((r["nodes"], r[ykey]))
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, pts in sorted(series.items()):
        pts.sort()
        ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=label)
    ax.set_xlabel("nodes")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    print(f"wrote {path}", file=sys.stderr)


# ------------------------------------------------------------------------------- hpl

def cmd_hpl(args) -> int:
    for flag, value in (("N", args.N), ("NB", args.nb), ("P", args.P), ("Q", args.Q)):
        if value is not None and value < 1:
            raise UsageError(f"{flag} must be >= 1, got {value}")
    rows: list[dict] = []
    lines = [f"{'link':>13} {'nodes':>5} {'ranks':>5} {'N':>8} {'NB':>4} {'PxQ':>6} "
             f"{'Gflops':>10} {'time s':>9} {'mem':>5}  update/laswp/panel/bcast/swap/solve s"]
    for name, k, cl in clusters(args):
        nranks = cl.ranks
        if args.P or args.Q:
            p = args.P or nranks // args.Q
            q = args.Q or nranks // p
            if p * q > nranks:
                raise UsageError(f"-P {p} -Q {q} needs {p * q} ranks; the cluster has {nranks}")
            nranks = p * q
        if args.N and args.nb and (args.P or args.Q):
            preds = [hplmod.predict(cl, hplmod.HplCase(args.N, args.nb, p, q, args.depth,
                                                       args.bcast, args.swap))]
        else:
            nbs = (args.nb,) if args.nb else (64, 96, 128, 192, 256, 384)
            preds = hplmod.suggest(cl, nranks, args.N, args.fill, nbs, args.depth, args.bcast,
                                   args.swap)
            if args.P or args.Q:
                preds = [r for r in preds if (r.p, r.q) == (p, q)]
        best = preds[0]
        rec = {"link": name, "nodes": k, "ranks": nranks, **best.as_dict()}
        rows.append(rec)
        parts = "/".join(f"{getattr(best, f):.3g}" for f in
                         ("update_s", "laswp_s", "panel_s", "bcast_s", "swap_s", "solve_s"))
        lines.append(f"{name:>13} {k:>5} {nranks:>5} {best.n:>8} {best.nb:>4} "
                     f"{f'{best.p}x{best.q}':>6} {best.gflops:>10.1f} {best.time_s:>9.3g} "
                     f"{best.memory_fraction:>5.0%}  {parts}")
        if best.memory_fraction > 1:
            lines.append(f"{'':>13} warning: N={best.n} needs {best.memory_fraction:.0%} of "
                         "the smallest rank's memory")
    _emit(args, rows, lines)
    if args.plot:
        plot(args.plot, rows, "gflops", "predicted HPL Gflop/s", "HPL")
    return 0


# ------------------------------------------------------------------------------- llm

def llm_cases(args, cl: clmod.Cluster, shape) -> list:
    """The predictions the flags ask for on one cluster: one layout, or all of them."""
    from hpcmac.plan import llm as llmmod

    nranks = cl.ranks
    kw = {"batch": args.batch, "prompt": args.prompt, "context": args.context,
          "act_bytes": args.act_bytes, "kv_bytes": args.kv_bytes,
          "backend": "mlx" if args.backend == "mlx" else "", "transport": args.transport or "",
          "fast_synch": args.mlx_fast_synch}
    if args.tp or args.pp:
        tp = args.tp or max(1, nranks // args.pp)
        pp = args.pp or max(1, nranks // tp)
        if tp * pp > nranks:
            raise UsageError(f"--tp {tp} --pp {pp} needs {tp * pp} ranks; the cluster has {nranks}")
        return [llmmod.predict(cl, shape, llmmod.LlmCase(tp, pp, args.layout == "star", **kw))]
    if args.layout == "star":
        return [llmmod.predict(cl, shape, llmmod.LlmCase(1, nranks, True, **kw))]
    preds = llmmod.choose(cl, shape, nranks=nranks, **kw)
    if args.layout != "all":
        want = {"pipeline": "pipeline", "tensor": "tensor", "hybrid": "hybrid"}.get(args.layout)
        if want:
            preds = [r for r in preds if r.layout == want] or preds[:1]
    return preds


def placement_of(args, cl: clmod.Cluster, pred) -> tuple[str, dict | None] | None:
    """(line, JSON) of the placement the runtime would take for ``pred``'s tp x pp on
    ``cl`` (:func:`hpcmac.llm.parallel.placement.place`, each node's memory its budget),
    or None when the model is not a checkpoint the runtime can open (a config.json or a
    header alone): the prediction needs no weights, the placement counts their bytes."""
    from hpcmac.llm.parallel.placement import Cluster, LayoutFlags, ModelSizes, place
    from hpcmac.llm.parallel.plan import GIB

    try:
        from hpcmac.llm.model.config import load_config

        cfg = load_config(args.model)
        sizes = ModelSizes(args.model)
    except (UsageError, OSError, ValueError, KeyError, ImportError):
        return None
    hosts = [n.name for n in cl.nodes for _ in range(n.slots)][:pred.tp * pred.pp]
    mem = {n.name: int(n.rates.memory_gb * GIB) for n in cl.nodes}
    cluster = Cluster(tuple(hosts), tuple(mem[h] for h in hosts))
    try:
        p = place(cfg, sizes, cluster, LayoutFlags(tp=pred.tp, pp=pred.pp),
                  kv_tokens=args.batch * args.context, sequences=args.batch)
    except UsageError as exc:
        return f"does not fit: {exc}", None
    return (p.describe() if p.size > 1 else "one rank holds the whole model"), p.json()


def cmd_llm(args) -> int:
    from hpcmac.plan.shape import load_shape

    for flag, value, least in (("--batch", args.batch, 1), ("--prompt", args.prompt, 1),
                               ("--context", args.context, 0), ("--act-bytes", args.act_bytes, 1),
                               ("--kv-bytes", args.kv_bytes, 1)):
        if value < least:
            raise UsageError(f"{flag} must be >= {least}, got {value}")
    if args.bits is not None and not 0 < args.bits <= 64:
        raise UsageError(f"--bits must be in (0, 64], got {args.bits}")
    if args.numpy and args.backend == "mlx":
        raise UsageError("--numpy and --backend mlx name two backends: give one")
    if args.backend == "mlx" and args.calibration:
        raise UsageError("--backend mlx predicts from a table machine's published GPU "
                         "figures; --calibration measures hpcmac's CPU decoder: give one")
    if args.backend != "mlx" and (args.transport or args.mlx_fast_synch):
        raise UsageError("--transport and --mlx-fast-synch describe the MLX backend: "
                         "add --backend mlx")
    args.numpy = args.numpy or args.backend == "numpy"
    shape = load_shape(args.model)
    if args.numpy:
        if shape.bits >= 16:  # float checkpoints are widened; quantized ones stay quantized
            shape = shape.with_bits(32.0, "hpcmac numpy backend (float32)", shape.edge_bits)
        args.act_bytes, args.kv_bytes = 4, 4
    if args.bits:
        shape = shape.with_bits(args.bits, "--bits")
    rows: list[dict] = []
    figures: list[str] = []
    lines = [f"# {shape.name}: {shape.arch}, {shape.n_layers} layers, "
             f"{shape.params() / 1e9:.3g}B parameters ({shape.active_params() / 1e9:.3g}B "
             f"read per token), {shape.bits:.3g} bits per weight ({shape.source_bits})",
             f"{'link':>13} {'nodes':>5} {'layout':>9} {'tp x pp':>7} {'tok/s':>8} "
             f"{f'B={args.batch} tok/s':>11} {'TTFT s':>8} {'GB/rank':>8}  "
             "per token ms: stream/fixed/allreduce/hops"]
    for name, k, cl in clusters(args):
        preds = llm_cases(args, cl, shape)
        for i, r in enumerate(preds):
            chosen = i == 0
            rec = {"link": name, "nodes": k, "chosen": chosen, **r.as_dict()}
            placed = placement_of(args, cl, r) if chosen else None
            if placed is not None:
                rec["placement"] = placed[1]
            rows.append(rec)
            mark = "*" if chosen else " "
            fit = "" if r.fits else " (does not fit)"
            lines.append(
                f"{name:>13} {k:>5} {r.layout:>8}{mark} {f'{r.tp}x{r.pp}':>7} "
                f"{r.decode_tok_s:>8.2f} {r.batch_tok_s:>11.2f} {r.ttft_s:>8.3g} "
                f"{r.memory_gb:>8.3g}  {r.stream_s * 1e3:.3g}/{r.fixed_s * 1e3:.3g}/"
                f"{r.allreduce_s * 1e3:.3g}/{r.hops_s * 1e3:.3g}"
                + (f"; syncs {r.host_syncs:g}: {r.sync_s * 1e3:.3g}"
                   + (f" (sums: {r.sums})" if r.sums else "") if r.backend else "")
                + fit + (f"  [{r.note}]" if r.note else ""))
            if r.figures and r.figures not in figures:
                figures.append(r.figures)
            if placed is not None:
                lines.append(f"{'':>13} placement: {placed[0]}")
    lines.append("* the layout chosen: the fastest that fits for this batch")
    if figures:
        lines.append("--backend mlx: per token, the host syncs waited on and their ms")
    lines += [f"--backend mlx: {f}" for f in figures]
    _emit(args, rows, lines)
    if args.plot:
        best = [r for r in rows if r["layout"] in ("tensor", "pipeline", "hybrid", "star")]
        plot(args.plot, best, "decode_tok_s" if args.batch == 1 else "batch_tok_s",
             "predicted tok/s", shape.name)
    return 0


# ------------------------------------------------------------------------- calibrate

def cmd_calibrate(args) -> int:
    from hpcmac.plan.calibrate import calibrate

    cal = calibrate(quick=args.quick)
    lines = [f"# this node: {cal['cores']} cores, {cal['memory_gb']} GB, "
             f"measured in {cal['seconds']} s",
             "DGEMM Gflop/s by busy cores: "
             + ", ".join(f"{k}: {v}" for k, v in cal["dgemm_gflops"].items()),
             "DGEMM at k (fraction of large k): "
             + ", ".join(f"{k}: {v}" for k, v in cal["dgemm_k"].items()),
             "copy GB/s by busy cores: "
             + ", ".join(f"{k}: {v}" for k, v in cal["mem_bw_gbs"].items()),
             f"HPL panel: {cal['panel']['col_s'] * 1e6:.1f} us per column + "
             f"{cal['panel']['gflops']:.1f} Gflop/s"]
    lines.append("read GB/s by busy cores (the decoder's matrix-vector kernel): "
                 + ", ".join(f"{k}: {v}" for k, v in cal["read_bw_gbs"].items()))
    lines.append("SGEMM Gflop/s by busy cores: "
                 + ", ".join(f"{k}: {v}" for k, v in cal["sgemm_gflops"].items()))
    if "layer_s" in cal:
        lines.append(f"hpcmac decoder: {cal['layer_s'] * 1e6:.1f} us per layer + "
                     f"{cal['token_s'] * 1e6:.1f} us per step, fixed; weights streamed at "
                     f"{cal['decode_bw_gbs']:.1f} GB/s ({cal['stream_eff']:.0%} of its "
                     "matrix-vector kernel alone)")
    if "tensor" in cal:
        t = cal["tensor"]
        lines.append(f"hpcmac tensor runtime at {t['ranks']} ranks, beyond one rank: "
                     f"{t['reduce_s'] * 1e6:.1f} us per all-reduce + "
                     f"{t['step_s'] * 1e6:.1f} us per step; streaming meeting at every "
                     f"all-reduce {t['sync_frac']:.1%} slower")
        if "hop_s" in t:
            lines.append(f"hpcmac pipeline runtime, beyond one rank: {t['hop_s'] * 1e6:.1f} "
                         "us per hop")
    _emit(args, cal, lines)  # type: ignore[arg-type]
    return 0


def cmd_machines(args) -> int:
    recs = []
    lines = [f"{'machine':>9} {'memory':>7} {'GB/s':>6} {'cores':>7} {'FP64 CPU':>9} "
             f"{'FP32 GPU':>9}  source"]
    for m in mc.MACHINES.values():
        recs.append({"name": m.name, "memory_gb": m.memory_gb, "mem_bw_gbs": m.mem_bw_gbs,
                     "p_cores": m.p_cores, "e_cores": m.e_cores,
                     "cpu_fp64_gflops": m.cpu_fp64_gflops,
                     "gpu_fp32_tflops": m.gpu_fp32_tflops, "source": m.source,
                     "gpu_read_gbs": m.gpu_read[0], "gpu_read_source": m.gpu_read[1]})
        lines.append(f"{m.name:>9} {m.memory_gb:>5.0f}GB {m.mem_bw_gbs:>6.0f} "
                     f"{f'{m.p_cores}P+{m.e_cores}E':>7} {m.cpu_fp64_gflops:>8.0f}G "
                     f"{m.gpu_fp32_tflops:>8.1f}T  {m.source}"
                     + (f"; GPU sustains {m.gpu_sustained_gbs:g} GB/s "
                        f"[{m.gpu_sustained_source}]" if m.gpu_sustained_gbs else ""))
    lines.append("")
    lines.append(f"{'link':>9} {'alpha us':>9} {'GB/s':>6}  source")
    for lk in mc.LINKS.values():
        recs.append({"link": lk.name, "alpha_s": lk.alpha_s, "beta_bps": lk.beta_bps,
                     "source": lk.source})
        lines.append(f"{lk.name:>9} {lk.alpha_s * 1e6:>9.0f} {lk.beta_bps / 1e9:>6.2f}  "
                     f"{lk.source}")
    _emit(args, recs, lines)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="python -m hpcmac.plan", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    h = sub.add_parser("hpl", help="predict HPL; suggest N, NB and P x Q")
    _cluster_args(h)
    h.add_argument("-N", type=int, default=None, help="matrix order (default: fill --fill)")
    h.add_argument("--nb", type=int, default=None, help="block size (default: best of a few)")
    h.add_argument("-P", type=int, default=None)
    h.add_argument("-Q", type=int, default=None)
    h.add_argument("--depth", type=int, default=1, choices=(0, 1))
    h.add_argument("--bcast", default="1ringM", choices=hplmod.BCASTS)
    h.add_argument("--swap", default="mix", choices=hplmod.SWAPS)
    h.add_argument("--fill", type=float, default=0.8,
                   help="fraction of the memory the matrix may fill (default 0.8)")
    _output_args(h)
    h.set_defaults(func=cmd_hpl)
    lm = sub.add_parser("llm", help="predict decode tok/s and time to first token")
    lm.add_argument("model", help="model folder, config.json, GGUF file (its header is "
                    "enough) or short name (smollm2)")
    _cluster_args(lm)
    lm.add_argument("--layout", default="all",
                    choices=("all", "pipeline", "tensor", "hybrid", "star"),
                    help="all (default: every layout, the chosen one marked), or one; "
                         "star = llama.cpp RPC's layer split through the main host")
    lm.add_argument("--tp", type=int, default=None, help="ranks per tensor group")
    lm.add_argument("--pp", type=int, default=None, help="pipeline stages")
    lm.add_argument("--batch", type=int, default=1, help="sequences decoded together")
    lm.add_argument("--prompt", type=int, default=512, help="prompt tokens (time to first token)")
    lm.add_argument("--context", type=int, default=2048, help="tokens in the KV cache")
    lm.add_argument("--bits", type=float, default=None,
                    help="bits per weight in memory (default: as the checkpoint stores them)")
    lm.add_argument("--act-bytes", type=int, default=2, help="bytes per activation sent")
    lm.add_argument("--kv-bytes", type=int, default=2, help="bytes per KV cache element")
    lm.add_argument("--numpy", action="store_true",
                    help="hpcmac's numpy backend: float weights widened to float32 "
                         "(quantized ones stay quantized), float32 activations and cache")
    lm.add_argument("--backend", choices=("numpy", "mlx"), default=None,
                    help="numpy: as --numpy; mlx: hpcmac's MLX backend on a table machine's "
                         "GPU, from published figures (labelled so; docs/plan.md)")
    lm.add_argument("--transport", choices=("ring", "rdma", "mpi"), default=None,
                    help="--backend mlx: the tensor groups' transport (ring or rdma: sums in "
                         "MLX's graph; mpi: the numpy bridge); default rdma on an RDMA link, "
                         "else ring")
    lm.add_argument("--mlx-fast-synch", action="store_true",
                    help="--backend mlx: as with MLX_METAL_FAST_SYNCH=1 (exo sets it)")
    _output_args(lm)
    lm.set_defaults(func=cmd_llm)
    c = sub.add_parser("calibrate", help="measure this node (DGEMM, memory bandwidth, panel)")
    c.add_argument("--json", type=checked_output("--json"), metavar="FILE",
                   help="write the measurements ('-': stdout)")
    c.add_argument("--quick", action="store_true", help="fewer repeats")
    c.set_defaults(func=cmd_calibrate)
    m = sub.add_parser("machines", help="the table of machines and links")
    m.add_argument("--json", type=checked_output("--json"), metavar="FILE")
    m.set_defaults(func=cmd_machines)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    t0 = time.perf_counter()
    if getattr(args, "fill", 0.8) is not None and not 0 < getattr(args, "fill", 0.8) <= 1:
        raise UsageError(f"--fill must be in (0, 1], got {args.fill}")
    code = args.func(args)
    if getattr(args, "verbose", False):
        print(f"answered in {time.perf_counter() - t0:.3f} s", file=sys.stderr)
    return code


if __name__ == "__main__":
    raise SystemExit(run_cli(main))
