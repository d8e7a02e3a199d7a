"""Predictions for a running job: the cluster it runs on, every layout it could take.

Used by ``python -m hpcmac.llm generate`` to choose its default layout and to
record the prediction next to what it measures. The job knows its ranks' hosts
and transport; the node's figures come from a calibration file
(``HPCMAC_PLAN_CALIBRATION``, written by ``python -m hpcmac.plan calibrate
--json FILE``) or from the hostfile's ``machine`` fields, the link from the
hostfile's ``link``, a measured ``HPCMAC_PLAN_COMM`` report, or the transport
(``rdma``: Thunderbolt 5 RDMA). Without node figures there is no prediction,
and the reason says how to give them. Pure apart from reading those files.
"""

from __future__ import annotations

import os
from dataclasses import replace

from hpcmac.errors import UsageError
from hpcmac.plan import cluster as clmod
from hpcmac.plan import llm as llmmod
from hpcmac.plan import machines as mc
from hpcmac.plan.shape import ModelShape, load_shape

CALIBRATION_ENV, COMM_ENV = "HPCMAC_PLAN_CALIBRATION", "HPCMAC_PLAN_COMM"


def job_cluster(hosts: list[str], hostfile=None,
                transport: str = "") -> tuple[clmod.Cluster | None, str]:
    """(cluster, "") for ranks on ``hosts`` (rank order), or (None, why not).

    ``hostfile``: a path, or the job's hostfile read once
    (:class:`hpcmac.llm.parallel.runtime.JobHostfile`, its JSON in ``data``)."""
    names: list[str] = []
    for h in hosts:
        if not names or names[-1] != h:
            if h in names:
                return None, "ranks of one host are not consecutive"
            names.append(h)
    slots = [hosts.count(n) for n in names]
    cal = os.environ.get(CALIBRATION_ENV) or None
    comm = os.environ.get(COMM_ENV) or None
    link = None
    rates: list[mc.Rates] = []
    try:
        hf_hosts: dict = {}
        if hostfile:
            # a hostfile the job has read already (its parsed JSON in ``data``), or a path
            raw = hostfile.data if hasattr(hostfile, "data") else \
                clmod.read_json(hostfile, "hostfile")
            if isinstance(raw, dict):
                link = raw.get("link")
                for h in raw.get("hosts") or []:
                    if isinstance(h, dict):
                        for key in (h.get("name"), h.get("ssh")):
                            if key:
                                hf_hosts[key] = h
        for n in names:
            h = hf_hosts.get(n, {})
            if cal:
                r = clmod.calibration_rates(cal)
            elif h.get("machine"):
                r = mc.rates_of(mc.machine(h["machine"]), h.get("memory_gb"))
            else:
                return None, (f"no figures for host {n}: set {CALIBRATION_ENV}=FILE (from "
                              "python -m hpcmac.plan calibrate --json FILE) or give the host a "
                              "'machine' in the hostfile")
            if h.get("memory_gb"):
                r = replace(r, memory_gb=float(h["memory_gb"]))
            rates.append(r)
        if link is None and len(names) > 1:
            if comm is None and transport != "rdma":
                return None, ("hosts joined by an unknown link: give the hostfile a 'link' "
                              f"or set {COMM_ENV}=FILE (python -m hpcmac.bench.comm --json)")
            link = "tb5-rdma" if transport == "rdma" else None
        lk = mc.link(link) if link else clmod.SHARED_MEMORY
        cl = clmod.Cluster(tuple(clmod.Node(n, r, s) for n, r, s in zip(names, rates, slots)),
                           lk, blas_threads=1 if max(slots) > 1 else None)
        if comm:
            measured, across = clmod.comm_link(comm)
            cl = replace(cl, link=measured) if across > 1 else replace(cl, local=measured)
    except (UsageError, KeyError) as exc:
        return None, str(exc.args[0] if exc.args else exc)
    return cl, ""


def runtime_shape(model: str, backend: str = "numpy", quantize: int | None = None,
                  group_size: int = 64) -> tuple[ModelShape, int]:
    """The model as hpcmac's runtime holds it, and the bytes of an activation element."""
    shape = load_shape(model)
    if quantize:
        return shape.with_bits(quantize + 32.0 / group_size, f"--quantize {quantize}"), 2
    if backend == "numpy":
        if shape.bits >= 16:
            shape = shape.with_bits(32.0, "numpy backend (float32)", shape.edge_bits)
        return shape, 4
    return shape, 2


def predict_layouts(model: str, hosts: list[str], *, hostfile=None,
                    transport: str = "", sequences: int = 1, prompt: int = 128,
                    context: int = 2048, backend: str = "numpy", quantize: int | None = None,
                    group_size: int = 64) -> tuple[list[llmmod.LlmPrediction], str]:
    """Every layout of ``len(hosts)`` ranks, fastest first for ``sequences`` (those that
    fit first), or ([], why there is none)."""
    cl, why = job_cluster(hosts, hostfile, transport)
    if cl is None:
        return [], why
    shape, act = runtime_shape(model, backend, quantize, group_size)
    out = [p for p in llmmod.choose(cl, shape, sequences, prompt, context, len(hosts), act, act)
           if p.tp <= shape.n_heads]
    return out, ""


def for_generate(model: str, hosts: list[str], *, hostfile, transport: str,
                 sequences: int, prompt: int, context: int, backend: str,
                 quantize: int | None, group_size: int) -> tuple[list, str]:
    """:func:`predict_layouts` for ``generate``, never raising: a model or file the
    planner cannot read gives no prediction and the reason, and generation goes on."""
    try:
        return predict_layouts(model, hosts, hostfile=hostfile, transport=transport,
                               sequences=sequences, prompt=prompt, context=context,
                               backend=backend, quantize=quantize, group_size=group_size)
    except (UsageError, OSError, ValueError, KeyError) as exc:
        return [], f"the planner could not read the model ({exc})"


def _rate(p: llmmod.LlmPrediction) -> float:
    return p.batch_tok_s if p.batch > 1 else p.decode_tok_s


def why_chosen(preds: list[llmmod.LlmPrediction]) -> str:
    """One line: the predicted fastest layout and the runner-up."""
    best = preds[0]
    unit = f"tok/s for {best.batch} sequences" if best.batch > 1 else "tok/s"
    line = f"hpcmac.plan predicts {_rate(best):.1f} {unit}"
    others = [p for p in preds[1:] if p.fits]
    if others:
        o = others[0]
        line += f" against {_rate(o):.1f} for {o.layout} {o.tp}x{o.pp}"
    return line


def prediction_json(preds: list[llmmod.LlmPrediction], tp: int, pp: int, why_not: str) -> dict:
    """What ``generate --json`` records: the prediction for the layout run, and the others."""
    if not preds:
        return {"available": False, "why": why_not}
    ran = [p for p in preds if (p.tp, p.pp) == (tp, pp)]
    out: dict = {"available": True,
                 "layouts": [{"tp": p.tp, "pp": p.pp, "decode_tok_s": p.decode_tok_s,
                              "batch_tok_s": p.batch_tok_s, "ttft_s": p.ttft_s, "fits": p.fits}
                             for p in preds]}
    if ran:
        out.update(ran[0].as_dict())
    return out
