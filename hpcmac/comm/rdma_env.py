"""Pure helpers for the ``rdma`` transport (MLX JACCL over Thunderbolt).

Everything that needs a Mac is split into two halves: a thin probe that runs a
command (``rdma_ctl status``, ``ibv_devices``) and a pure function that reads
its output. The pure halves are tested on recorded outputs
(``tests/unit/fixtures/rdma``); the probes run only where the tools exist.

The device matrix is MLX's JACCL format: ``matrix[i][j]`` names the RDMA
device on rank ``i`` that is cabled to rank ``j`` (a string, a list of strings
for several cables, or ``null`` on the diagonal). ``mlx.launch`` passes it as a
JSON file in ``MLX_IBV_DEVICES``; hpcmac also reads ``HPCMAC_IBV_DEVICES``
(a path or inline JSON, either the bare matrix or an MLX hostfile with
``rdma`` rows).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from typing import Any

from hpcmac.comm import rdma_ready

Matrix = list[list[Any]]

ENABLE_HINT = "run rdma_ctl enable from Recovery"


def load_device_matrix(spec: str) -> Matrix:
    """The device matrix from ``spec``: a JSON file path or inline JSON.

    Accepts the bare matrix ``[[null, "rdma_en2"], ["rdma_en2", null]]``, an MLX
    hostfile ``{"hosts": [{"ssh": ..., "rdma": [...]}, ...]}`` or its list of
    hosts. Raises ValueError with one line naming the source on bad input.
    """
    text, where = spec, "inline JSON"
    if not spec.lstrip().startswith(("[", "{")):
        where = spec
        try:
            with open(spec, encoding="utf-8") as fh:
                text = fh.read()
        except OSError as exc:
            raise ValueError(f"device matrix {spec}: cannot read ({exc.strerror})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(
            f"device matrix {where}: not JSON (line {exc.lineno}: {exc.msg})") from None
    if isinstance(data, dict):
        data = data.get("hosts")
    if isinstance(data, list) and data and all(isinstance(h, dict) for h in data):
        if not all("rdma" in h for h in data):
            raise ValueError(f"device matrix {where}: a host has no 'rdma' field")
        data = [h["rdma"] for h in data]
    if not isinstance(data, list) or not all(isinstance(row, list) for row in data):
        raise ValueError(f"device matrix {where}: expected a list of rows (one per rank)")
    return data


def _names(entry: Any) -> list[str]:
    if entry is None:
        return []
    if isinstance(entry, str):
        return [entry]
    if isinstance(entry, list) and all(isinstance(e, str) for e in entry):
        return list(entry)
    raise ValueError(f"device entry {entry!r} is not null, a name or a list of names")


def check_device_matrix(
    matrix: Matrix, size: int, rank: int | None = None, local_devices: list[str] | None = None,
    port_states: dict[str, str] | None = None,
) -> str:
    """'' when ``matrix`` is a usable full mesh for ``size`` ranks, else the first problem.

    With ``rank`` and ``local_devices`` (this host's ``ibv_devices``) it also
    checks that every device named in this rank's row exists here, and with
    ``port_states`` (this host's ``ibv_devinfo``) that its port is ``PORT_ACTIVE``.
    """
    if len(matrix) != size:
        return f"device matrix has {len(matrix)} rows for {size} ranks"
    for i, row in enumerate(matrix):
        if len(row) != size:
            return f"device matrix row {i} has {len(row)} entries for {size} ranks"
        for j, entry in enumerate(row):
            try:
                names = _names(entry)
            except ValueError as exc:
                return f"device matrix [{i}][{j}]: {exc}"
            if i == j and names:
                return f"device matrix [{i}][{i}] must be null (a rank has no link to itself)"
            if i != j and not names:
                return f"device matrix [{i}][{j}] is null: ranks {i} and {j} are not cabled"
    if rank is not None and local_devices is not None:
        for j, entry in enumerate(matrix[rank]):
            for name in _names(entry):
                if name not in local_devices:
                    have = ", ".join(local_devices) or "none"
                    return (f"rank {rank}: device {name} (towards rank {j}) "
                            f"not in ibv_devices ({have})")
                if port_states is not None and port_states.get(name) != "PORT_ACTIVE":
                    state = port_states.get(name, "not in ibv_devinfo")
                    return (f"rank {rank}: device {name} (towards rank {j}) port is {state}, "
                            "not PORT_ACTIVE (reseat the cable; restart both Macs if it stays "
                            "down)")
    return ""


def jaccl_env(rank: int, devices_file: str, coordinator: str | None = None,
              ring: bool = False) -> dict[str, str]:
    """The environment MLX's JACCL backend reads for this rank.

    ``coordinator`` ("ip:port" of rank 0) is needed only without an
    ``all_gather_factory`` side channel; ``ring`` asks for JACCL's ring
    algorithms instead of the mesh.
    """
    env = {"MLX_RANK": str(int(rank)), "MLX_IBV_DEVICES": devices_file}
    if coordinator:
        env["MLX_JACCL_COORDINATOR"] = coordinator
    if ring:
        env["MLX_JACCL_RING"] = "1"
    return env


def rdma_reason(
    platform: str,
    has_jaccl: bool,
    rdma_ctl_out: str | None,
    ibv_devices_out: str | None,
    matrix_spec: str | None,
) -> str:
    """Why ``rdma`` is unusable on this rank ('' when it is usable). Pure.

    ``rdma_ctl_out``/``ibv_devices_out`` are the commands' outputs, None when
    the command is missing or failed.
    """
    if not has_jaccl:
        if platform.startswith("linux"):
            return "rdma: mlx has no jaccl backend on Linux"
        return "rdma: this mlx build has no jaccl backend (needs macOS 26.2+ on Apple silicon)"
    if rdma_ctl_out is not None and rdma_ready.parse_rdma_ctl(rdma_ctl_out) is False:
        return f"rdma: RDMA disabled, {ENABLE_HINT}"
    devices = rdma_ready.parse_ibv_devices(ibv_devices_out)
    if not any(d.startswith("rdma_en") for d in devices):
        return "rdma: no rdma_en* device (ibv_devices lists none; check cables and rdma_ctl status)"
    if not matrix_spec:
        return "rdma: no device matrix (set HPCMAC_IBV_DEVICES or launch with an rdma hostfile)"
    return ""


def matrix_spec_from_env(env: dict[str, str] | None = None) -> str | None:
    """Where this rank's device matrix comes from: HPCMAC_IBV_DEVICES, then MLX_IBV_DEVICES."""
    env = os.environ if env is None else env
    return env.get("HPCMAC_IBV_DEVICES") or env.get("MLX_IBV_DEVICES") or None


def _run(cmd: list[str]) -> str | None:
    """stdout of ``cmd``, or None when it is not installed, fails or takes over 10 s."""
    if shutil.which(cmd[0]) is None:
        return None
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return proc.stdout if proc.returncode == 0 else None


def probe(has_jaccl: bool) -> str:
    """Run the Mac-side checks on this host; '' when rdma is usable here (not collective)."""
    if not has_jaccl:
        return rdma_reason(sys.platform, False, None, None, None)
    return rdma_reason(sys.platform, True, _run(["rdma_ctl", "status"]),
                       _run(["ibv_devices"]), matrix_spec_from_env())


def local_devices() -> list[str]:
    """This host's RDMA device names (empty where ``ibv_devices`` is absent)."""
    return rdma_ready.parse_ibv_devices(_run(["ibv_devices"]))


def local_port_states() -> dict[str, str] | None:
    """{device: port state} from this host's ``ibv_devinfo``; None where it is absent."""
    text = _run(["ibv_devinfo"])
    return None if text is None else rdma_ready.parse_ibv_devinfo(text)


def port_problem(rank: int, row: list, ports: list[rdma_ready.Port] | None) -> str:
    """'' when every device in this rank's ``row`` sits on a port that can do RDMA.

    ``ports`` is this Mac's Thunderbolt ports (:func:`local_ports`), None where
    ``system_profiler`` is absent (nothing to check). Pure.
    """
    if ports is None:
        return ""
    by_iface = {p.iface: p for p in ports}
    for j, entry in enumerate(row):
        for name in _names(entry):
            port = by_iface.get(name.removeprefix("rdma_"))
            why = rdma_ready.port_cannot_rdma(port) if port is not None else ""
            if why:
                return f"rank {rank}: device {name} (towards rank {j}): {why}"
    return ""


def local_ports() -> list[rdma_ready.Port] | None:
    """This Mac's Thunderbolt ports from ``system_profiler`` (None elsewhere or on failure)."""
    tb = _run(["system_profiler", "SPThunderboltDataType", "-json"])
    hw = _run(["networksetup", "-listallhardwareports"])
    if not tb or hw is None:
        return None
    try:
        return rdma_ready.parse_thunderbolt(tb, rdma_ready.parse_hardware_ports(hw))
    except rdma_ready.ProfilerError:
        return None
