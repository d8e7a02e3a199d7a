"""What a decode step costs hpcmac's MLX backend on an Apple GPU: published figures only.

None of these was measured here (this project's machines have no Apple GPU); each
carries the key of its source in docs/plan.md's list, and the planner labels every
prediction that uses them "published, not measured here". A measurement on the GPU
(``../shared/gpu/mlx_gpu_check.py``) is to replace them. Per decode step of one stage:

* **weights** stream at the GPU's published bandwidth: the sustained figure where one
  is published (M3 Ultra: 650-690 GB/s of 819, [mlx-bw]), else the peak;
* **kernels**: a decode step is a chain of dependent kernels, each costing a fixed
  ``kernel_s`` beyond its bytes, ``kernels_per_layer`` a layer; MLX commits a Metal
  command buffer every 50 kernels or 50 MB of inputs (Ultra parts), which for layers of
  large matrices trips about once a layer, each boundary costing ``cbuf_s``, and once
  more at the step's end [mlx-cbuf];
* **host syncs**: each sync the token waits on (:mod:`hpcmac.llm.parallel.host_syncs`
  counts them by layout) costs ``host_sync_s``; at one rank the step's one sync
  overlaps the next step's building and costs nothing [mlx-async-eval];
* **collectives in the graph** (tensor parallel over an MLX group): Metal has no GPU
  all_sum, so each collective is a GPU -> CPU -> GPU crossing of ``crossing_s``
  (``MLX_METAL_FAST_SYNCH=1``: ``crossing_fast_s``; hpcmac leaves it unset, exo sets
  it) [mlx-fence], beside its message over the link (``machines.LINKS``).

Pure: no I/O, no MPI.
"""

from __future__ import annotations

from dataclasses import dataclass

#: the label every figure of this module carries in the planner's output
LABEL = "published, not measured here"


@dataclass(frozen=True)
class MlxCosts:
    """The MLX-on-Metal step costs (global). Source keys in docs/plan.md."""

    # mlx#4521 (M3 Ultra, mlx 0.32.2): 3,200 tiny dependent kernels take 8.8 ms a step at
    # 50 kernels per command buffer, 7.7 ms at 200: the 48 fewer buffers save 1.1 ms
    # (23 us each, "about 20 us"), leaving (7.7 ms - 16 x 23 us) / 3,200 = 2.3 us a kernel
    kernel_s: float = 2.3e-6
    cbuf_s: float = 23e-6
    # mlx#4521: GLM (45 layers, MoE and hybrid attention) runs ~1,600 kernels a token;
    # the only published count per layer, taken for every layer
    kernels_per_layer: float = 1600 / 45
    # mlx#4521: "the byte rule trips roughly once per layer"
    cbufs_per_layer: float = 1.0
    # mlx#972 (95.9 -> 99.7 tok/s) and mlx#992 (103.5 -> 107.5) when the token's one sync
    # stopped blocking (mx.async_eval): 0.39 and 0.36 ms a token
    host_sync_s: float = 0.38e-3
    # mlx#4438 (M3 Ultra, mlx 0.32.2): a CPU <-> GPU stream crossing ~180 us with the
    # default fence, ~4 us with MLX_METAL_FAST_SYNCH=1
    crossing_s: float = 180e-6
    crossing_fast_s: float = 4e-6
    source: str = "mlx-cbuf, mlx-async-eval, mlx-fence"

    def step_fixed_s(self, layers: int) -> float:
        """Kernels and command buffers of one step over ``layers`` layers."""
        per_layer = self.kernels_per_layer * self.kernel_s + self.cbufs_per_layer * self.cbuf_s
        return layers * per_layer + self.cbuf_s

    def crossing(self, fast_synch: bool) -> float:
        return self.crossing_fast_s if fast_synch else self.crossing_s

    def describe(self, fast_synch: bool) -> str:
        """One line of the figures used, with their label and sources."""
        return (f"{LABEL}: {self.kernel_s * 1e6:.1f} us a kernel x "
                f"{self.kernels_per_layer:.1f} a layer, {self.cbuf_s * 1e6:.0f} us a command "
                f"buffer ({self.cbufs_per_layer:g} a layer + 1 a step), "
                f"{self.host_sync_s * 1e3:.2f} ms a blocking host sync, "
                f"{self.crossing(fast_synch) * 1e6:.0f} us a collective's CPU-GPU crossing"
                f" ({'MLX_METAL_FAST_SYNCH=1' if fast_synch else 'default fence'}) "
                f"[{self.source}]")


MLX = MlxCosts()
