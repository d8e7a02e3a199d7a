"""The flags of ``generate`` and ``serve`` and the checks every rank makes on them.

Shared by :mod:`hpcmac.llm.cli` (``generate``) and :mod:`hpcmac.llm.server`
(``serve``): the same flags, the same rules, one place. Local and pure: every
rank makes the same checks before any collective.
"""

from __future__ import annotations

import argparse
import os

from hpcmac.errors import UsageError
from hpcmac.io.inputs import float_arg, int_arg
from hpcmac.io.outputs import output_path
from hpcmac.llm.model.sampling import SamplingParams
from hpcmac.llm.parallel.layout import check_layout_flags


def add_generate_args(g: argparse.ArgumentParser, prompts: bool = True) -> None:
    """The flags of ``generate``: the model, the prompt(s), sampling, and the layout."""
    g.add_argument("--model", required=True,
                   help="model folder (config.json + safetensors), GGUF file, or 'smollm2'")
    src = g.add_mutually_exclusive_group(required=prompts)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-ids", help="prompt as comma-separated token ids, e.g. 1,2,3")
    src.add_argument("--batch", metavar="FILE",
                     help='prompts to generate together: one per line, or JSON lines with '
                          '"prompt" or "prompt_ids" and optional "max_tokens"')
    g.add_argument("--max-tokens", type=int_arg, default=64)
    g.add_argument("--temperature", type=float_arg, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-k", type=int_arg, default=0)
    g.add_argument("--top-p", type=float_arg, default=1.0)
    g.add_argument("--repetition-penalty", type=float_arg, default=1.0)
    g.add_argument("--seed", type=int_arg, default=None)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--system", default=None, help="system message for the chat template")
    g.add_argument("--ignore-chat-template", action="store_true",
                   help="use the prompt text as is, even if the model has a chat template")
    g.add_argument("--max-context", type=int_arg, default=None,
                   help="context length (default: the model's, capped at 4096)")
    g.add_argument("--backend", default="numpy", help="numpy (default) or mlx")
    g.add_argument("--quantize", type=int_arg, default=None, metavar="BITS",
                   help="keep the weights quantized in memory, BITS per weight (4 or 8; "
                        "also 2, 3, 5, 6), as mlx-lm's -q (--backend mlx)")
    g.add_argument("--q-group-size", type=int_arg, default=64, metavar="G",
                   help="weights sharing one scale and bias when quantized (32, 64, 128)")
    g.add_argument("--int8-activations", action="store_true", default=None,
                   help="numpy backend, quantized weights: round each run of 32 activations "
                        "to 8 bits and multiply integers, as llama.cpp does (faster; logits "
                        "no longer equal float32 inference's; also HPCMAC_INT8_ACTIVATIONS=1)")
    g.add_argument("--threads", type=int_arg, default=None,
                   help="BLAS threads (default: the BLAS library's choice)")
    g.add_argument("--json", type=output_path, default=None,
                   metavar="FILE", help="write results as JSON")
    g.add_argument("--quiet", action="store_true", help="do not stream the text")
    g.add_argument("--prefix-cache-gb", type=float_arg, default=None, metavar="GB",
                   help="KV kept of prompts already computed, reused by prompts that start "
                        "with them (a chat's earlier turns, a shared system prompt), in GiB "
                        "per rank at most, least recently used dropped first (default: 1, "
                        "at most half the memory the weights leave; 0: off)")
    d = g.add_argument_group("speculative decoding (docs/serve.md)")
    dm = d.add_mutually_exclusive_group()
    dm.add_argument("--draft-model", default=None, metavar="PATH",
                    help="a smaller model with the same tokenizer proposes tokens that the "
                         "model verifies, several in one forward pass (on rank 0)")
    dm.add_argument("--draft", choices=("ngram",), default=None,
                    help="ngram: propose what followed the last matching n-gram of the "
                         "prompt and output (prompt lookup, no model)")
    d.add_argument("--draft-k", type=int_arg, default=DRAFT_K, metavar="K",
                   help=f"draft tokens verified per step (default {DRAFT_K})")
    p = g.add_argument_group("several ranks (pipeline and tensor parallel)")
    p.add_argument("--tp", type=int, default=None, metavar="T",
                   help="ranks per tensor-parallel group (default: all ranks for one "
                        "sequence on one host or RDMA, else 1)")
    p.add_argument("--pp", type=int, default=None, metavar="P",
                   help="pipeline stages (T x P = ranks)")
    p.add_argument("--tp-split", default=None, metavar="SHARES",
                   help="shares of the tensor ranks, e.g. 2,1,1 (default: by memory)")
    p.add_argument("--split", help="layers per stage, e.g. 10,10,6,4 (default: by memory)")
    p.add_argument("--transport", choices=("auto", "mpi", "rdma", "ring", "local"),
                   help="comm backend (default: HPCMAC_TRANSPORT or auto)")
    p.add_argument("--hostfile", help="JSON hostfile whose memory_gb sets the split "
                                      "(default: HPCMAC_HOSTFILE)")
    p.add_argument("--micro-batches", type=int_arg, default=0,
                   help="micro-batches in flight (default: one per stage)")
    p.add_argument("--max-batch", type=int_arg, default=0,
                   help="sequences decoded at once (default: all prompts, at most 64)")
    p.add_argument("--prefill-chunk", type=int_arg, default=0,
                   help="prompt tokens per micro-batch (default: 512 on one rank; on "
                        "several, 4 chunks per stage, 32 to 512 tokens each)")
    p.add_argument("--timeout", type=float_arg, default=60.0,
                   help="seconds a rank waits on a silent peer before ending the job "
                        "(at least 1; 0: no watchdog)")


#: draft tokens per speculative step unless ``--draft-k`` says otherwise
DRAFT_K = 4

#: the most draft tokens a step may verify
MAX_DRAFT_K = 64

#: the shortest ``--timeout`` (seconds of a silent peer) a run accepts, 0 aside
MIN_TIMEOUT = 1.0

#: most BLAS threads ``--threads`` may ask for (and no more than the host's logical CPUs)
MAX_THREADS = 1024


def check_threads(threads: int | None) -> None:
    """UsageError unless ``--threads`` fits this host's logical CPUs (local: run it
    through ``agree`` so a rank on a smaller host names itself)."""
    cpus = os.cpu_count() or 1
    if threads is not None and threads > cpus:
        raise UsageError(f"--threads {threads}: expected 1 to {cpus} (this host's "
                         "logical CPUs)")


def check_arguments(args: argparse.Namespace) -> SamplingParams:
    """Local checks every rank makes identically before any collective; the sampling."""
    from hpcmac.llm.model.backend import check_int8_activations, check_quantize

    if args.max_tokens < 0:
        raise UsageError(f"--max-tokens {args.max_tokens}: expected >= 0")
    if args.max_context is not None and args.max_context < 1:
        raise UsageError(f"--max-context {args.max_context}: expected >= 1")
    if args.threads is not None and not 1 <= args.threads <= MAX_THREADS:
        raise UsageError(f"--threads {args.threads}: expected 1 to {MAX_THREADS}")
    if args.seed is not None and not 0 <= args.seed < 1 << 63:
        # numpy's generators take no negative seed; the HTTP "seed" field has the same bound
        raise UsageError(f"--seed {args.seed}: expected an integer from 0 to 2^63-1")
    for name in ("prompt", "system"):
        text = getattr(args, name, None)
        if text is not None:
            _utf8(text, f"--{name}")
    for text in args.stop:
        _utf8(text, "--stop")
    check_quantize(args.backend, args.quantize, args.q_group_size)
    check_int8_activations(args.backend, args.int8_activations)
    sampling = SamplingParams(args.temperature, args.top_k, args.top_p,
                              args.repetition_penalty, args.seed)
    sampling.validate()
    gb = getattr(args, "prefix_cache_gb", None)
    if gb is not None and not 0 <= gb <= 1 << 20:
        raise UsageError(f"--prefix-cache-gb {gb:g}: expected a size in GiB, 0 (off) or more")
    for name in ("micro_batches", "max_batch", "prefill_chunk"):
        if getattr(args, name) < 0:
            raise UsageError(f"--{name.replace('_', '-')} {getattr(args, name)}: expected >= 0")
    if args.timeout < 0 or 0 < args.timeout < MIN_TIMEOUT:
        # a watchdog shorter than a healthy step ended the job as "rank 1 has died or hung"
        raise UsageError(f"--timeout {args.timeout:g}: expected 0 (no watchdog) or at least "
                         f"{MIN_TIMEOUT:g} s (one healthy step can take longer than that)")
    check_layout_flags(args.tp, args.pp, args.tp_split)
    if not 1 <= args.draft_k <= MAX_DRAFT_K:
        raise UsageError(f"--draft-k {args.draft_k}: expected 1 to {MAX_DRAFT_K}")
    return sampling


def draft_of(args: argparse.Namespace) -> str | None:
    """The drafter the flags ask for: ``--draft-model``'s path, "ngram", or None."""
    return getattr(args, "draft_model", None) or getattr(args, "draft", None)


def _utf8(text: str, where: str) -> None:
    """UsageError unless ``text`` (from argv: undecodable bytes arrive as surrogates) is text."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise UsageError(f"{where}: expected UTF-8 text, found an undecodable byte at "
                         f"character {exc.start}") from None


def context_length(args, cfg) -> int:
    """Tokens the KV cache may hold per sequence: ``--max-context`` (1 to the model's
    ``max_position``) or the model's (<= 4096)."""
    if args.max_context is None:
        return min(cfg.max_position, 4096)
    n = args.max_context
    if not 1 <= n <= cfg.max_position:
        raise UsageError(f"--max-context {n}: expected 1 to {cfg.max_position} (the model's "
                         "context length)")
    return n
