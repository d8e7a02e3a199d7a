"""hpcmac.limits reads a memory cgroup's limit, v2 and v1 (hybrid hosts), from the files
the kernel writes; a limit it cannot read or "unlimited" means no cgroup limit."""

from hpcmac import limits


def _tree(tmp_path, proc: str, files: dict[str, str]):
    (tmp_path / "cgroup").write_text(proc)
    for rel, text in files.items():
        f = tmp_path / "fs" / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(text + "\n")
    return str(tmp_path / "cgroup"), str(tmp_path / "fs")


def test_cgroup_v2_limit_less_usage(tmp_path):
    proc, root = _tree(tmp_path, "0::/job\n", {"job/memory.max": "4294967296",
                                                "job/memory.current": "1073741824"})
    assert limits._cgroup_left(proc, root) == 3 << 30
    proc, root = _tree(tmp_path, "0::/job\n", {"job/memory.max": "max",
                                                "job/memory.current": "5"})
    assert limits._cgroup_left(proc, root) is None


def test_cgroup_v1_memory_controller(tmp_path):
    proc = "9:pids:/\n4:memory:/a/b\n1:cpu,cpuacct:/\n0::/\n"
    proc_f, root = _tree(tmp_path, proc, {"memory/a/b/memory.limit_in_bytes": "3221225472",
                                          "memory/a/b/memory.usage_in_bytes": "1073741824"})
    assert limits._cgroup_left(proc_f, root) == 2 << 30
    proc_f, root = _tree(tmp_path, proc, {
        "memory/a/b/memory.limit_in_bytes": "9223372036854771712",
        "memory/a/b/memory.usage_in_bytes": "1"})
    assert limits._cgroup_left(proc_f, root) is None


def test_cgroup_unreadable_is_no_limit(tmp_path):
    proc, root = _tree(tmp_path, "0::/gone\n4:memory:/gone\n", {})
    assert limits._cgroup_left(proc, root) is None
    assert limits._cgroup_left(str(tmp_path / "absent"), root) is None
