"""Memory a restore needs vs what the host and its memory cgroup offer (pure parts over fake
/proc texts and cgroup trees in a temp dir; the real cgroup is in test_integration_more.py)."""

from __future__ import annotations

from pathlib import Path

from vllm_snapshot.host import resources
from vllm_snapshot.host.resources import Offer

GIB = 1 << 30


def _mountinfo(v2: Path | None, v1: Path | None) -> str:
    lines = ["22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw"]
    if v2:
        lines.append(f"30 22 0:26 / {v2} rw,nosuid shared:9 - cgroup2 cgroup2 rw")
    if v1:
        lines.append(f"31 22 0:27 / {v1} rw,nosuid shared:10 - cgroup cgroup rw,memory")
        lines.append("32 22 0:28 / /sys/fs/cgroup/cpu rw,nosuid shared:11 - cgroup cgroup rw,cpu,cpuacct")
    return "\n".join(lines) + "\n"


def _write(d: Path, files: dict[str, str]) -> None:
    d.mkdir(parents=True, exist_ok=True)
    for k, v in files.items():
        (d / k).write_text(v + "\n")


def test_mem_available_bytes():
    assert resources.mem_available("MemTotal: 100 kB\nMemAvailable:   2048 kB\n") == 2 * 1024 * 1024


def test_v2_smallest_headroom_over_ancestors_counts_working_set(tmp_path):
    v2 = tmp_path / "v2"
    _write(v2 / "system.slice", {"memory.max": str(8 * GIB), "memory.current": str(1 * GIB),
                                 "memory.stat": "anon 1\ninactive_file 0"})
    _write(v2 / "system.slice" / "svc", {"memory.max": str(1 * GIB), "memory.current": str(GIB // 2),
                                         "memory.stat": f"anon 1\ninactive_file {GIB // 4}"})
    room, why = resources.cgroup_headroom("0::/system.slice/svc\n", _mountinfo(v2, None))
    assert room == GIB - GIB // 4  # limit - (usage - inactive file cache)
    assert "memory cgroup /system.slice/svc (v2): limit 1.00 GiB" in why


def test_v2_without_limits_and_v1_unlimited_give_none(tmp_path):
    v2, v1 = tmp_path / "v2", tmp_path / "v1"
    _write(v2 / "a", {"memory.max": "max", "memory.current": "5"})
    _write(v1 / "a", {"memory.limit_in_bytes": str(9223372036854771712), "memory.usage_in_bytes": "5"})
    assert resources.cgroup_headroom("0::/a\n4:memory:/a\n", _mountinfo(v2, v1)) is None


def test_v1_memory_controller_on_a_hybrid_host(tmp_path):
    v1 = tmp_path / "memory"
    _write(v1 / "process_api" / "x", {"memory.limit_in_bytes": str(700 << 20),
                                      "memory.usage_in_bytes": str(100 << 20),
                                      "memory.stat": "cache 0\ntotal_inactive_file 0"})
    text = "9:name=systemd:/\n4:memory:/process_api/x\n0::/\n"
    room, why = resources.cgroup_headroom(text, _mountinfo(tmp_path / "unified", v1))
    assert room == 600 << 20 and "(v1)" in why


def test_check_names_both_numbers():
    assert resources.check(GIB, Offer(2 * GIB, "MemAvailable 2.00 GiB")) is None
    msg = resources.check(int(1.4 * GIB), Offer(700 << 20, "memory cgroup /x (v1): limit 0.68 GiB"))
    assert "needs about 1.40 GiB" in msg and "only 0.68 GiB is available: memory cgroup /x" in msg
