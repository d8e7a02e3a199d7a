"""MLX distributed transports: ``ring`` (TCP) and ``rdma`` (JACCL over Thunderbolt).

Placeholder until the comm issue lands: reports both as unavailable.
"""

from __future__ import annotations


def is_available(name: str) -> tuple[bool, str]:
    return False, f"{name}: MLX transports not built yet"


def init_group(name, world):
    raise RuntimeError(f"{name}: MLX transports not built yet")
