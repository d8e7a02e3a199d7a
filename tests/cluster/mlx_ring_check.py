"""One MLX ring all_sum across the ranks mlx.launch started; rank 0 prints PASSED.

Run by test_mesh.py through ``python -m hpcmac.launch --via mlx --backend ring``.
"""

import socket
import sys

import mlx.core as mx

group = mx.distributed.init(backend="ring", strict=True)
n = 1 << 20  # 4 MiB of float32 per rank
x = mx.full((n,), float(group.rank() + 1))
total = mx.distributed.all_sum(x, group=group)
mx.eval(total)
expect = group.size() * (group.size() + 1) / 2
hosts = mx.distributed.all_gather(mx.array([len(socket.gethostname())]), group=group)
mx.eval(hosts)
print(f"rank {group.rank()} on {socket.gethostname()}", flush=True)
if not bool(mx.all(total == expect)):
    print(f"error: all_sum on {socket.gethostname()} gave {total[0].item()}, expected {expect}",
          file=sys.stderr)
    sys.exit(3)
if group.rank() == 0:
    print(f"mlx ring all_sum over {group.size()} ranks ... PASSED", flush=True)
