"""Known machines and links: published figures only, each with its source key.

Every number here is a hardware figure as published (or derived from published
core counts and clocks); ``docs/plan.md`` lists the sources by key. Nothing is
fitted to the benchmark results the model is checked against. Measured values
(``python -m hpcmac.plan calibrate``, ``python -m hpcmac.bench.comm --json``)
override these per node and per link.

Pure: no I/O, no MPI.
"""

from __future__ import annotations

from dataclasses import dataclass, field

#: DGEMM reaches this fraction of the FP64 vector peak in a tuned BLAS at large
#: sizes (BLIS and OpenBLAS on Arm and x86 report 85-95%; source ``blis-arm``).
DGEMM_EFFICIENCY = 0.9
#: half-efficiency inner dimension of a rank-k update (DGEMM with k = NB): the
#: rate is ``peak * eff * k / (k + K_HALF)``; packing costs amortise over k.
K_HALF = 16.0
#: panel factorisation rate as a fraction of DGEMM when not measured: the panel
#: is narrow (NB columns), mostly level-2 and small level-3 BLAS.
PANEL_FRACTION = 0.25
#: fixed cost per panel column (pivot search, swap, scaling calls) when not measured
PANEL_COLUMN_S = 2e-6


@dataclass(frozen=True)
class Machine:
    """One Apple-silicon part (or a measured node), per node. Global."""

    name: str
    memory_gb: float            # largest memory configuration (a hostfile may say less)
    mem_bw_gbs: float           # unified-memory bandwidth, GB/s (1e9)
    p_cores: int
    p_ghz: float
    e_cores: int
    e_ghz: float
    gpu_fp32_tflops: float      # GPU FP32 peak (the GPU has no FP64)
    source: str                 # key into docs/plan.md's source list
    fp64_per_cycle_p: int = 16  # 4 x 128-bit FMA pipes: 4 * 2 doubles * 2 flops
    fp64_per_cycle_e: int = 8   # 2 x 128-bit FMA pipes
    gpu_sustained_gbs: float | None = None   # what the GPU sustains streaming, where
    gpu_sustained_source: str = ""           # published (else the peak is used)

    @property
    def gpu_read(self) -> tuple[float, str]:
        """(GB/s the GPU streams weights at, where the figure comes from): the published
        sustained figure where there is one, else the published peak."""
        if self.gpu_sustained_gbs:
            return self.gpu_sustained_gbs, f"sustained [{self.gpu_sustained_source}]"
        return self.mem_bw_gbs, f"peak [{self.source}]"

    @property
    def cores(self) -> int:
        return self.p_cores + self.e_cores

    @property
    def cpu_fp64_gflops(self) -> float:
        """FP64 vector peak of the CPU cores (NEON FMA), Gflop/s."""
        return (self.p_cores * self.p_ghz * self.fp64_per_cycle_p
                + self.e_cores * self.e_ghz * self.fp64_per_cycle_e)

    @property
    def cpu_fp32_gflops(self) -> float:
        return 2 * self.cpu_fp64_gflops


@dataclass(frozen=True)
class Link:
    """A link type: latency ``alpha_s`` (one small message, one way) and bandwidth."""

    name: str
    alpha_s: float
    beta_bps: float             # bytes per second, large messages
    source: str
    rdma: bool = False
    switched: bool = False      # one port per node through a switch (Ethernet), else a
                                # cable per pair of nodes (Thunderbolt mesh)

    def time(self, nbytes: float) -> float:
        """Seconds to move one message of ``nbytes`` (alpha-beta model)."""
        return self.alpha_s + nbytes / self.beta_bps


MACHINES: dict[str, Machine] = {m.name: m for m in (
    Machine("m1-ultra", 128, 800, 16, 3.2, 4, 2.06, 21.0, "apple-m1-ultra"),
    Machine("m2-ultra", 192, 800, 16, 3.5, 8, 2.4, 27.2, "apple-m2-ultra"),
    # the GPU sustains 650-690 GB/s of the 819 (source mlx-bw)
    Machine("m3-ultra", 512, 819, 24, 4.05, 8, 2.75, 28.4, "apple-m3-ultra",
            gpu_sustained_gbs=670, gpu_sustained_source="mlx-bw"),
    Machine("m4-max", 128, 546, 12, 4.5, 4, 2.9, 18.4, "apple-m4-max"),
    Machine("m4-pro", 64, 273, 10, 4.5, 4, 2.9, 9.2, "apple-m4-pro"),
    Machine("m4", 32, 120, 4, 4.4, 6, 2.9, 4.3, "apple-m4"),
)}

GBIT = 1e9 / 8

LINKS: dict[str, Link] = {lk.name: lk for lk in (
    # TCP over Ethernet through a switch: line rate less ~6% framing (source ethernet-tcp);
    # macOS TCP small-message latency as measured over Thunderbolt (source geerling-rdma)
    Link("2.5gbe", 300e-6, 2.5 * GBIT * 0.94, "geerling-rdma", switched=True),
    Link("10gbe", 300e-6, 9.4 * GBIT, "geerling-m4-mini", switched=True),
    # Thunderbolt 5 IP networking: ~50-60 Gbit/s per cable in practice (source tb5-tcp)
    Link("tb5-tcp", 300e-6, 55 * GBIT, "tb5-tcp"),
    # RDMA over Thunderbolt 5 (macOS 26.2): < 50 us (source geerling-rdma)
    Link("tb5-rdma", 50e-6, 55 * GBIT, "geerling-rdma", rdma=True),
)}


def machine(name: str) -> Machine:
    """The table's machine ``name``; KeyError lists the known names."""
    try:
        return MACHINES[name]
    except KeyError:
        raise KeyError(f"unknown machine {name!r}; known: {', '.join(MACHINES)}") from None


def link(name: str) -> Link:
    try:
        return LINKS[name]
    except KeyError:
        raise KeyError(f"unknown link {name!r}; known: {', '.join(LINKS)}") from None


@dataclass(frozen=True)
class Rates:
    """What the performance model needs of one node (a table part or a measurement).

    ``dgemm`` maps busy cores -> node DGEMM Gflop/s at large k; ``dgemm_k`` maps
    k -> fraction of that rate for a rank-k update (measured, else K_HALF's
    curve). ``mem_bw`` maps busy cores -> GB/s. ``panel_col_s`` and
    ``panel_gflops`` are the panel factorisation's per-column cost and rate.
    ``layer_s`` and ``token_s`` are the LLM runtime's fixed costs per layer and
    per decode step (kernel launches, Python), 0 when unknown. ``reduce_s`` and
    ``tp_step_s`` are what hpcmac's tensor runtime pays beyond one rank, measured
    at 2 ranks of this node (:mod:`hpcmac.plan.tensor_cost`): per all-reduce,
    beyond the link's alpha and beta, and per decode step (the leader's step
    messages, the embedding's all-reduce, the head's max-loc); ``tp_sync_frac``
    how much longer two ranks streaming their shards take when they meet at
    every all-reduce (the slower sets the pace); ``hop_s`` what a pipeline step of
    hpcmac's runtime pays per hop beyond one rank's step and the link (the stages'
    scheduling, the receiving stage's wake-up), measured in the same 2-rank job;
    0 when unknown. ``gpu_read_gbs``: a table part's GPU streaming rate for the MLX
    backend (published; 0 for a measured node, whose GPU nothing here measured).
    """

    name: str
    cores: int
    memory_gb: float
    dgemm: dict[int, float]
    mem_bw: dict[int, float]
    dgemm_k: dict[int, float] = field(default_factory=dict)
    panel_col_s: float = PANEL_COLUMN_S
    panel_gflops: float | None = None
    layer_s: float = 0.0
    token_s: float = 0.0                 # the LLM runtime's fixed cost per decode step
    reduce_s: float = 0.0                # tensor runtime: cost per all-reduce beyond the link
    tp_step_s: float = 0.0               # tensor runtime: cost per decode step beyond one rank
    tp_sync_frac: float = 0.0            # tensor runtime: streaming stretched by meeting peers
    hop_s: float = 0.0                   # pipeline runtime: cost per hop beyond the link
    stream_eff: float = 1.0              # one core's whole-decoder read rate / read_bw[1]
    flops_fp32: float | None = None      # Gflop/s for prefill (matrix-matrix), FP32/FP16 path
    read_bw: dict[int, float] = field(default_factory=dict)   # GB/s reading, by busy cores
    sgemm: dict[int, float] = field(default_factory=dict)     # Gflop/s FP32, by busy cores
    source: str = ""
    gpu_read_gbs: float = 0.0            # a table part's GPU streaming rate (MLX); 0: none
    gpu_read_source: str = ""

    def dgemm_at(self, busy: int, k: float | None = None) -> float:
        """Node DGEMM Gflop/s with ``busy`` cores working (all ranks together)."""
        rate = _interp(self.dgemm, busy)
        if k is not None:
            rate *= self.k_fraction(k)
        return rate

    def k_fraction(self, k: float) -> float:
        if self.dgemm_k:
            return min(1.0, _interp(self.dgemm_k, k))
        big = 1024.0
        return (k / (k + K_HALF)) / (big / (big + K_HALF))

    def bw_at(self, busy: int) -> float:
        """Node memory bandwidth in bytes/s with ``busy`` cores streaming."""
        return _interp(self.mem_bw, busy) * 1e9

    def read_bw_at(self, busy: int) -> float:
        """Bytes/s the node's decoders read with ``busy`` cores streaming (weights in
        decode): each core at most what one core's decoder reaches alone (the one-core
        read rate times ``stream_eff``, a limit of the core), all of them at most what
        the node's memory gives ``busy`` cores reading at once (``read_bw``: calibrate
        measures it with the decoder's matrix-vector kernel at each core count)."""
        table = self.read_bw or self.mem_bw
        one_core = _interp(table, 1) * self.stream_eff
        return min(busy * one_core, _interp(table, busy)) * 1e9

    def matrix_flops(self, busy: int) -> float:
        """Flop/s of the node's matrix products for the LLM (GPU FP32, or measured SGEMM)."""
        if self.sgemm:
            return _interp(self.sgemm, busy) * 1e9
        if self.flops_fp32:
            return self.flops_fp32 * 1e9
        return 2.0 * self.dgemm_at(busy) * 1e9

    def panel_rate(self, busy: int) -> float:
        """Panel factorisation flop/s of one rank's core(s)."""
        if self.panel_gflops is not None:
            return self.panel_gflops * 1e9
        return PANEL_FRACTION * self.dgemm_at(busy) * 1e9 / max(1, busy)


def _interp(table: dict[int, float], x: float) -> float:
    """Piecewise-linear in x over the table's keys, flat beyond the ends."""
    keys = sorted(table)
    if x <= keys[0]:
        return table[keys[0]] if keys[0] <= 1 or x >= keys[0] else table[keys[0]] * x / keys[0]
    for a, b in zip(keys, keys[1:]):
        if x <= b:
            return table[a] + (table[b] - table[a]) * (x - a) / (b - a)
    return table[keys[-1]]


def rates_of(m: Machine, memory_gb: float | None = None) -> Rates:
    """The model's view of a table part: linear in cores up to the published peak."""
    peak = m.cpu_fp64_gflops * DGEMM_EFFICIENCY
    return Rates(
        name=m.name, cores=m.cores, memory_gb=memory_gb or m.memory_gb,
        dgemm={1: peak / m.cores, m.cores: peak},
        mem_bw={1: m.mem_bw_gbs, m.cores: m.mem_bw_gbs},
        flops_fp32=m.gpu_fp32_tflops * 1e3, source=m.source, gpu_read_gbs=m.gpu_read[0],
        gpu_read_source=m.gpu_read[1])
