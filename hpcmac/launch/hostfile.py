"""The hpcmac hostfile: JSON schema, loading, and pure validation.

A Thunderbolt cluster has no switch: every cable is its own point-to-point
link with its own small subnet. The hostfile says which hosts there are and
how they are cabled::

    {
      "topology": "mesh",                       # "mesh" (default) or "ring"
      "backend": "jaccl",                       # optional: mlx.launch backend
      "envs": ["OMP_NUM_THREADS=1"],           # optional: KEY=VALUE for every rank
      "hosts": [
        {"name": "mac1", "ssh": "mac1.local", "slots": 1, "memory_gb": 512,
         "ips": ["192.168.1.11"]},              # management (Ethernet) addresses
        {"name": "localhost", "slots": "auto"},  # "auto": this machine's cores (local only)
        ...
      ],
      "links": [
        {"subnet": "10.77.12.0/30",
         "ends": [{"host": "mac1", "iface": "en2", "addr": "10.77.12.1", "rdma": "rdma_en2"},
                  {"host": "mac2", "iface": "en2", "addr": "10.77.12.2", "rdma": "rdma_en2"}]},
        ...
      ]
    }

It is a superset of ``mlx.launch``'s hostfile: a host may also carry MLX's
``rdma`` row (checked against the links), and an ``mlx.launch`` hostfile (a
list of ``{"ssh", "ips", "rdma"}`` or ``{"backend", "envs", "hosts"}``) is
accepted as input; its hosts are named after their ``ssh`` field.

Everything here is pure: :func:`parse` turns decoded JSON into a
:class:`Hostfile` and :func:`validate` returns one line per problem.
:func:`load` reads a file and raises :class:`~hpcmac.errors.UsageError` with
the first problem, naming the file.
"""

from __future__ import annotations

import ipaddress
import math
import re
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from hpcmac.errors import UsageError
from hpcmac.io.inputs import parse_json, read_text

# names, interfaces, devices: what a shell passes through unchanged
_SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._@-]*$")
_SAFE_ENV_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
#: what ``ssh`` may be: ``[user@]host``, a POSIX user name and a DNS name or IPv4
#: address (``%+=,:/`` would reach Open MPI's hostfile verbatim: ``:`` is MPICH's slot
#: separator, ``,`` a list, ``/`` and ``%`` are no part of a host name)
_SSH_NAME = re.compile(r"^(?:[A-Za-z0-9_][A-Za-z0-9._-]*@)?[A-Za-z0-9][A-Za-z0-9.-]*$")
_SHELL_META = set(";&|`$<>()\\\"' \t\n*?[]{}!#~")
TOPOLOGIES = ("mesh", "ring")
BACKENDS = ("", "ring", "jaccl", "jaccl-ring", "mpi")
MAX_MESH_HOSTS = 4  # no TB5 switches: every Mac needs a port per peer
# bounds that keep checking and converting a hostfile to milliseconds
MAX_HOSTS = 1024
MAX_LINKS = 8192
MAX_SLOTS = 1024  # ranks on one host (cores of the largest machines)
MAX_MEMORY_GB = 1e6
MAX_HOSTFILE_BYTES = 1 << 20


@dataclass(frozen=True)
class Host:
    """One machine. ``ssh`` is what ssh (or the launch agent) is given."""

    name: str
    ssh: str
    slots: int = 1
    memory_gb: float | None = None
    ips: tuple[str, ...] = ()
    rdma: tuple[str | None, ...] | None = None  # MLX's row, if given
    python: str | None = None  # the Python to run there (absolute path); default: the launcher's


@dataclass(frozen=True)
class End:
    """One end of a cable: the host, its interface, address, RDMA device."""

    host: str
    iface: str
    addr: str
    rdma: str | None = None


@dataclass(frozen=True)
class Link:
    """A point-to-point cable with its own subnet."""

    subnet: str
    ends: tuple[End, End]

    def end_of(self, host: str) -> End:
        return self.ends[0] if self.ends[0].host == host else self.ends[1]

    def peer_of(self, host: str) -> End:
        return self.ends[1] if self.ends[0].host == host else self.ends[0]

    @property
    def label(self) -> str:
        return f"{self.ends[0].host}-{self.ends[1].host}"


@dataclass(frozen=True)
class Hostfile:
    """A parsed hostfile (not yet validated: see :func:`validate`)."""

    hosts: tuple[Host, ...]
    links: tuple[Link, ...] = ()
    topology: str = "mesh"
    backend: str = ""
    envs: tuple[str, ...] = ()
    source: str = "<hostfile>"
    mlx_format: bool = False

    @property
    def names(self) -> list[str]:
        return [h.name for h in self.hosts]

    @cached_property
    def _by_name(self) -> dict[str, Host]:
        out: dict[str, Host] = {}
        for h in self.hosts:
            out.setdefault(h.name, h)
        return out

    @cached_property
    def _by_pair(self) -> dict[frozenset[str], Link]:
        out: dict[frozenset[str], Link] = {}
        for lk in self.links:
            out.setdefault(frozenset((lk.ends[0].host, lk.ends[1].host)), lk)
        return out

    def host(self, name: str) -> Host:
        return self._by_name[name]

    def links_of(self, name: str) -> list[Link]:
        return [lk for lk in self.links if name in (lk.ends[0].host, lk.ends[1].host)]

    def link_between(self, a: str, b: str) -> Link | None:
        """The first link joining hosts ``a`` and ``b`` (a dictionary look-up)."""
        return self._by_pair.get(frozenset((a, b)))

    def total_slots(self) -> int:
        return sum(h.slots for h in self.hosts)


# ---------------------------------------------------------------- parsing


def _req(obj: dict, key: str, where: str, kind: type | tuple[type, ...]) -> Any:
    if key not in obj:
        raise UsageError(f"{where}: missing field {key!r}")
    value = obj[key]
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        raise UsageError(f"{where}: field {key!r} should be {_kind(kind)}, found {value!r}")
    return value


def _opt(obj: dict, key: str, where: str, kind: type | tuple[type, ...], default: Any) -> Any:
    if key not in obj or obj[key] is None:
        return default
    return _req(obj, key, where, kind)


def _kind(kind: type | tuple[type, ...]) -> str:
    names = {str: "a string", int: "an integer", float: "a number", list: "a list",
             dict: "an object", bool: "true or false"}
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join(names.get(k, k.__name__) for k in kinds)


def _str_list(value: Any, where: str, key: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise UsageError(f"{where}: field {key!r} should be a list of strings, found {value!r}")
    return tuple(value)


def _rdma_row(value: Any, where: str) -> tuple[str | None, ...]:
    if not isinstance(value, list):
        raise UsageError(f"{where}: field 'rdma' should be a list, found {value!r}")
    row: list[str | None] = []
    for v in value:
        if isinstance(v, list):  # MLX allows several devices per peer; we keep the first
            v = v[0] if v else None
        if v is not None and not isinstance(v, str):
            raise UsageError(f"{where}: field 'rdma' entries should be strings or null, "
                             f"found {v!r}")
        row.append(v)
    return tuple(row)


#: the fields each object of a hostfile may have; anything else is refused with the nearest
#: of these (a misspelt "memroy_gb" must not silently drop "memory_gb"); a field whose
#: name starts with "_" is a comment and is ignored
#: "link" (the cables' type) and a host's "machine" (its part) are read by hpcmac.plan
TOP_KEYS = ("topology", "backend", "envs", "hosts", "links", "link")
HOST_KEYS = ("name", "ssh", "slots", "memory_gb", "ips", "rdma", "python", "machine")
LINK_KEYS = ("subnet", "ends")
END_KEYS = ("host", "iface", "addr", "rdma")
MLX_TOP_KEYS = ("backend", "envs", "hosts")
MLX_HOST_KEYS = ("ssh", "ips", "rdma")


def _known_fields(obj: dict, keys: tuple[str, ...], where: str) -> None:
    """UsageError naming the first field of ``obj`` not in ``keys``, and the nearest known one."""
    import difflib

    for k in obj:
        if k in keys or k.startswith("_"):
            continue
        near = difflib.get_close_matches(k, keys, n=1, cutoff=0.6)
        hint = f"did you mean {near[0]!r}?" if near else f"expected one of {', '.join(keys)}"
        raise UsageError(f"{where}: unknown field {k!r}: {hint} (a field whose name starts "
                         "with '_' is a comment)")


def local_cores() -> int:
    """Cores this process may use (its affinity mask where the OS has one)."""
    import os

    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


#: what ``"ssh"`` says for the machine that launches: ``"slots": "auto"`` may count its cores
LOCAL_NAMES = ("localhost", "127.0.0.1", "::1")


def _slots(h: dict, where: str) -> int:
    """A host's ``slots``: an integer, or ``"auto"`` = this machine's cores (local hosts only)."""
    if h.get("slots") == "auto":
        if h.get("ssh", h.get("name")) not in LOCAL_NAMES:
            raise UsageError(f"{where}: field 'slots' \"auto\" counts this machine's cores, so it "
                             f"is only for a host whose 'ssh' is one of {', '.join(LOCAL_NAMES)}")
        return local_cores()
    return _opt(h, "slots", where, int, 1)


def parse(data: Any, source: str = "<hostfile>") -> Hostfile:
    """Decoded JSON -> :class:`Hostfile`; a missing or mistyped field is a UsageError.

    Accepts the hpcmac schema and both ``mlx.launch`` forms.
    """
    if isinstance(data, list):
        if not data:
            raise UsageError(f"{source}: expected a list of hosts, found an empty list")
        return _parse_mlx({"hosts": data}, source)
    if not isinstance(data, dict):
        raise UsageError(f"{source}: expected a JSON object with 'hosts', "
                         f"found {type(data).__name__}")
    hosts_raw = _req(data, "hosts", source, list)
    is_mlx = "links" not in data and all(isinstance(h, dict) and "name" not in h
                                         for h in hosts_raw)
    _known_fields(data, MLX_TOP_KEYS if is_mlx and hosts_raw else TOP_KEYS, source)
    if not hosts_raw:
        raise UsageError(f"{source}: 'hosts' is empty")
    _cap(source, "hosts", len(hosts_raw), MAX_HOSTS)
    if isinstance(data.get("links"), list):
        _cap(source, "links", len(data["links"]), MAX_LINKS)
    if "links" not in data and all(isinstance(h, dict) and "name" not in h for h in hosts_raw):
        return _parse_mlx(data, source)
    hosts = []
    for i, h in enumerate(hosts_raw):
        where = f"{source}: hosts[{i}]"
        if not isinstance(h, dict):
            raise UsageError(f"{where}: expected an object, found {h!r}")
        name = _req(h, "name", where, str)
        where = f"{source}: host {name!r}"
        _known_fields(h, HOST_KEYS, where)
        memory = _opt(h, "memory_gb", where, (int, float), None)
        slots = _slots(h, where)
        rdma = _rdma_row(h["rdma"], where) if h.get("rdma") is not None else None
        hosts.append(Host(
            name=name,
            ssh=_opt(h, "ssh", where, str, name),
            slots=slots,
            memory_gb=float(memory) if memory is not None else None,
            ips=_str_list(h.get("ips", []), where, "ips"),
            rdma=rdma,
            python=_opt(h, "python", where, str, None),
        ))
    links = []
    for i, lk in enumerate(_opt(data, "links", source, list, [])):
        where = f"{source}: links[{i}]"
        if not isinstance(lk, dict):
            raise UsageError(f"{where}: expected an object, found {lk!r}")
        _known_fields(lk, LINK_KEYS, where)
        subnet = _req(lk, "subnet", where, str)
        ends_raw = _req(lk, "ends", where, list)
        if len(ends_raw) != 2:
            raise UsageError(f"{where}: 'ends' should have 2 entries, found {len(ends_raw)}")
        ends = []
        for k, e in enumerate(ends_raw):
            ewhere = f"{where}.ends[{k}]"
            if not isinstance(e, dict):
                raise UsageError(f"{ewhere}: expected an object, found {e!r}")
            _known_fields(e, END_KEYS, ewhere)
            ends.append(End(
                host=_req(e, "host", ewhere, str),
                iface=_req(e, "iface", ewhere, str),
                addr=_req(e, "addr", ewhere, str),
                rdma=_opt(e, "rdma", ewhere, str, None),
            ))
        links.append(Link(subnet=subnet, ends=(ends[0], ends[1])))
    envs = _str_list(data.get("envs", []), source, "envs")
    return Hostfile(
        hosts=tuple(hosts),
        links=tuple(links),
        topology=_opt(data, "topology", source, str, "mesh"),
        backend=_opt(data, "backend", source, str, ""),
        envs=envs,
        source=source,
    )


def _cap(source: str, key: str, count: int, most: int) -> None:
    if count > most:
        raise UsageError(f"{source}: '{key}' should have at most {most} entries, found {count}")


def _parse_mlx(data: dict, source: str) -> Hostfile:
    _cap(source, "hosts", len(data["hosts"]), MAX_HOSTS)
    hosts = []
    for i, h in enumerate(data["hosts"]):
        where = f"{source}: hosts[{i}]"
        if not isinstance(h, dict):
            raise UsageError(f"{where}: expected an object, found {h!r}")
        _known_fields(h, MLX_HOST_KEYS, where)
        ssh = _req(h, "ssh", where, str)
        rdma = _rdma_row(h["rdma"], where) if h.get("rdma") else None
        hosts.append(Host(name=ssh, ssh=ssh, ips=_str_list(h.get("ips", []), where, "ips"),
                          rdma=rdma))
    return Hostfile(
        hosts=tuple(hosts),
        backend=_opt(data, "backend", source, str, ""),
        envs=_str_list(data.get("envs", []), source, "envs"),
        source=source,
        mlx_format=True,
    )


_job: dict[str, tuple[Hostfile, Any] | UsageError] = {}


def job_hostfile_with_data(path: str | None = None) -> tuple[Hostfile, Any] | None:
    """:func:`job_hostfile` (strict) and the parsed JSON it came from: the same one read
    per process, for the planners (they read fields the schema keeps no copy of)."""
    import os

    path = path or os.environ.get("HPCMAC_HOSTFILE") or None
    if not path:
        return None
    key = os.path.abspath(path)
    if key not in _job:
        try:
            _job[key] = load_with_data(path)
        except UsageError as exc:
            _job[key] = exc
    got = _job[key]
    if isinstance(got, UsageError):
        raise got
    return got


def job_hostfile(path: str | None = None, strict: bool = False) -> Hostfile | None:
    """The hostfile this job was started with: ``path``, else ``HPCMAC_HOSTFILE`` (set by
    hpcmac.launch), else None. Read and validated once per process; whoever starts the
    job hands the value down (``comm.init(hostfile=...)``, the planners).

    ``strict``: a bad file raises its one-line UsageError; otherwise it is None (the
    launcher checked it; a rank only loses the link addresses). Not collective.
    """
    try:
        got = job_hostfile_with_data(path)
    except UsageError:
        if strict:
            raise
        return None
    return got[0] if got else None


def load(path: str | Path, check: bool = True) -> Hostfile:
    """Read and (with ``check``) validate a hostfile; any problem is one UsageError line."""
    return load_with_data(path, check)[0]


def load_with_data(path: str | Path, check: bool = True) -> tuple[Hostfile, Any]:
    """:func:`load`, and the parsed JSON as it was (for readers of fields the schema
    keeps no copy of, e.g. the planner's ``link`` and ``machine``): one read."""
    p = Path(path)
    # at most 1 MiB of strict UTF-8 from a regular file; JSON without NaN or deep nesting
    text = read_text(p, "hostfile", MAX_HOSTFILE_BYTES)
    data = parse_json(text, str(p))
    hf = parse(data, str(p))
    if check:
        problems = validate(hf)
        if problems:
            more = f" (and {len(problems) - 1} more problems)" if len(problems) > 1 else ""
            raise UsageError(f"{p}: {problems[0]}{more}")
    return hf, data


# ------------------------------------------------------------- validation


def is_safe_word(text: str) -> bool:
    """True when ``text`` has no shell metacharacters and cannot be read as an option."""
    return bool(text) and not (set(text) & _SHELL_META) and not text.startswith("-")


def is_ssh_name(text: str) -> bool:
    """True for ``host`` or ``user@host`` as a hostfile's ``ssh`` may give it."""
    return is_safe_word(text) and bool(_SSH_NAME.fullmatch(text))


def env_value_ok(value: str) -> bool:
    """True when an environment value has no control character (newline, tab, NUL):
    mpirun's ``-x`` and mlx.launch's hostfile carry values as one line."""
    return not any(ord(c) < 0x20 or ord(c) == 0x7f for c in value)


def _check_addr(addr: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(addr)
    except ValueError:
        return None


def validate(hf: Hostfile) -> list[str]:
    """Every problem in ``hf``, one line each naming the host or link and the field.

    Pure: reads nothing but ``hf``. An empty list means the hostfile is usable.
    """
    out: list[str] = []
    names = hf.names
    seen: set[str] = set()
    ssh_of: dict[str, str] = {}
    for h in hf.hosts:
        machine = h.ssh.split("@")[-1]
        if machine in ssh_of and h.name not in seen:
            out.append(f"host {h.name!r}: field 'ssh' {h.ssh!r} is also host "
                       f"{ssh_of[machine]!r}'s (list a machine once and give it 'slots')")
        ssh_of.setdefault(machine, h.name)
        if not _SAFE_NAME.fullmatch(h.name):
            out.append(f"host {h.name!r}: field 'name' must be letters, digits, '.', '_', '-' "
                       "(no spaces or shell metacharacters)")
        if not is_ssh_name(h.ssh):
            out.append(f"host {h.name!r}: field 'ssh' {h.ssh!r} must be a plain host name "
                       "or user@host (letters, digits, '.', '-'; no spaces, shell "
                       "metacharacters or %+=,:/)")
        if h.name in seen:
            out.append(f"host {h.name!r}: field 'name' is used twice")
        seen.add(h.name)
        if not 1 <= h.slots <= MAX_SLOTS:
            out.append(f"host {h.name!r}: field 'slots' must be a positive integer "
                       f"(at most {MAX_SLOTS}), found {h.slots}")
        if h.memory_gb is not None and not (math.isfinite(h.memory_gb)
                                            and 0 < h.memory_gb <= MAX_MEMORY_GB):
            out.append(f"host {h.name!r}: field 'memory_gb' must be positive "
                       f"(at most {MAX_MEMORY_GB:g}), found {h.memory_gb}")
        for ip in h.ips:
            if _check_addr(ip) is None:
                out.append(f"host {h.name!r}: field 'ips' has {ip!r}, not an IP address")
        if h.python is not None and not (h.python.startswith("/") and is_safe_word(h.python)):
            out.append(f"host {h.name!r}: field 'python' must be an absolute path with no "
                       f"spaces or shell metacharacters, found {h.python!r}")
    if hf.topology not in TOPOLOGIES:
        out.append(f"field 'topology' must be one of {', '.join(TOPOLOGIES)}, "
                   f"found {hf.topology!r}")
    if hf.backend not in BACKENDS:
        out.append(f"field 'backend' must be one of {', '.join(b for b in BACKENDS if b)}, "
                   f"found {hf.backend!r}")
    for e in hf.envs:
        key = e.split("=", 1)[0]
        if "=" not in e or not _SAFE_ENV_KEY.fullmatch(key):
            out.append(f"field 'envs': {e!r} should be KEY=VALUE with KEY a shell variable name")
        elif not env_value_ok(e.split("=", 1)[1]):
            out.append(f"field 'envs': {e!r}: the value has a control character (a newline?); "
                       "launchers pass values as one line")
    out += _validate_links(hf, set(names))
    out += _validate_addresses(hf)
    out += _validate_rdma(hf)
    return out


def advise(hf: Hostfile) -> list[str]:
    """Warnings that do not stop a launch, one line each (pure).

    More than :data:`MAX_MESH_HOSTS` fully meshed hosts: with no Thunderbolt
    switch every Mac needs a port per peer, and the RDMA stack is proven on
    meshes of up to four; a ring of more is fine and not flagged.
    """
    out = []
    if hf.links and hf.topology == "mesh" and len(hf.hosts) > MAX_MESH_HOSTS:
        out.append(f"{len(hf.hosts)} hosts in a Thunderbolt full mesh: each Mac needs "
                   f"{len(hf.hosts) - 1} cabled ports and there is no Thunderbolt switch; "
                   f"meshes of more than {MAX_MESH_HOSTS} Macs are untested territory")
    return out


def _validate_links(hf: Hostfile, names: set[str]) -> list[str]:
    out: list[str] = []
    pairs: dict[frozenset[str], str] = {}
    for i, lk in enumerate(hf.links):
        label = f"link {i} ({lk.label})"
        a, b = lk.ends
        for e in (a, b):
            if e.host not in names:
                out.append(f"{label}: field 'host' {e.host!r} is not in 'hosts'")
            if not is_safe_word(e.iface) or not _SAFE_NAME.fullmatch(e.iface):
                out.append(f"{label}: field 'iface' {e.iface!r} on {e.host!r} is not a plain "
                           "interface name")
            if e.rdma is not None and (not is_safe_word(e.rdma)
                                       or not _SAFE_NAME.fullmatch(e.rdma)):
                out.append(f"{label}: field 'rdma' {e.rdma!r} on {e.host!r} is not a plain "
                           "device name")
        if a.host == b.host:
            out.append(f"{label}: field 'ends' joins {a.host!r} to itself")
            continue
        key = frozenset((a.host, b.host))
        if key in pairs:
            out.append(f"{label}: a second link between {a.host!r} and {b.host!r} "
                       f"(first is {pairs[key]}); give each cable its own host pair")
        pairs[key] = label
        try:
            net = ipaddress.ip_network(lk.subnet, strict=True)
        except ValueError:
            out.append(f"{label}: field 'subnet' {lk.subnet!r} is not a network like 10.77.1.0/30")
            continue
        for e in (a, b):
            addr = _check_addr(e.addr)
            if addr is None:
                out.append(f"{label}: field 'addr' {e.addr!r} on {e.host!r} is not an IP address")
            elif addr not in net or addr in (net.network_address, net.broadcast_address) \
                    and net.prefixlen < 31:
                out.append(f"{label}: field 'addr' {e.addr} on {e.host!r} is not a host address "
                           f"inside subnet {lk.subnet}")
    out += _overlapping_subnets(hf)
    if hf.links and not out:
        out += _validate_shape(hf)
    return out


def _overlapping_subnets(hf: Hostfile) -> list[str]:
    """Links whose subnets overlap an earlier link's (sorted sweep: n log n, not n^2)."""
    nets = []
    for i, lk in enumerate(hf.links):
        try:
            net = ipaddress.ip_network(lk.subnet, strict=True)
        except ValueError:
            continue
        nets.append((net.version, int(net.network_address), int(net.broadcast_address), i))
    nets.sort()
    clashes = []
    reach = None  # (version, highest address so far, its link)
    for version, lo, hi, i in nets:
        if reach is not None and reach[0] == version and lo <= reach[1]:
            x, y = sorted((reach[2], i))
            clashes.append((y, x))
        if reach is None or reach[0] != version or hi > reach[1]:
            reach = (version, hi, i)
    out = []
    for y, x in sorted(clashes):
        a, b = hf.links[x], hf.links[y]
        out.append(f"link {y} ({b.label}): field 'subnet' {b.subnet} overlaps link {x} "
                   f"({a.label}); each cable needs its own subnet")
    return out


def _validate_shape(hf: Hostfile) -> list[str]:
    from hpcmac.launch.topology import missing_mesh_pairs, ring_order

    if hf.topology == "mesh":
        missing = missing_mesh_pairs(hf)
        if missing:
            shown = ", ".join(f"{a}-{b}" for a, b in missing[:3])
            more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
            return [f"field 'links': not a full mesh, no link between {shown}{more} "
                    "(cable every pair, or say \"topology\": \"ring\")"]
    elif hf.topology == "ring" and len(hf.hosts) > 2 and ring_order(hf) is None:
        return ["field 'links': topology 'ring' but the links do not join every host "
                "into one cycle"]
    return []


def _validate_addresses(hf: Hostfile) -> list[str]:
    out: list[str] = []
    owner: dict[str, str] = {}
    for h in hf.hosts:
        for ip in h.ips:
            if ip in owner and owner[ip] != f"host {h.name!r} field 'ips'":
                out.append(f"host {h.name!r}: field 'ips' address {ip} is also {owner[ip]}")
            owner.setdefault(ip, f"host {h.name!r} field 'ips'")
    for i, lk in enumerate(hf.links):
        for e in lk.ends:
            where = f"link {i} ({lk.label}) 'addr' of {e.host!r}"
            if e.addr in owner:
                out.append(f"link {i} ({lk.label}): field 'addr' {e.addr} of {e.host!r} "
                           f"duplicates {owner[e.addr]}")
            else:
                owner[e.addr] = where
    return out


def _validate_rdma(hf: Hostfile) -> list[str]:
    out: list[str] = []
    names = hf.names
    n = len(names)
    for i, h in enumerate(hf.hosts):
        if h.rdma is None:
            continue
        if len(h.rdma) != n:
            out.append(f"host {h.name!r}: field 'rdma' has {len(h.rdma)} entries, expected one "
                       f"per host ({n})")
            continue
        if h.rdma[i] is not None:
            out.append(f"host {h.name!r}: field 'rdma' entry {i} (itself) must be null, "
                       f"found {h.rdma[i]!r}")
        for j, dev in enumerate(h.rdma):
            if j == i or not hf.links:
                continue
            lk = hf.link_between(h.name, names[j])
            want = lk.end_of(h.name).rdma if lk else None
            if dev != want:
                out.append(f"host {h.name!r}: field 'rdma' entry {j} ({names[j]}) is {dev!r} "
                           f"but the link says {want!r}")
    return out
