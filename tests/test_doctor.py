"""doctor: every check against fake probes (hosts this machine is not), the exit-code rule, and
the real probes / the real `vllm-snapshot doctor --json` on this machine."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
import os
import stat
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from vllm_snapshot.cli import app as cli, doctor
from vllm_snapshot.host import privilege
from vllm_snapshot.cli.doctor import Check
from vllm_snapshot.errors import EnvironmentProblem
from vllm_snapshot.checkpoint.gpu import GpuInfo
from vllm_snapshot.report.results import PartialPull

ROOT = Path(__file__).resolve().parent.parent
CRIU = "/opt/criu/criu/criu"
ALL_CAPS = (1 << 41) - 1


def _st(mode: int, uid: int = 0) -> os.stat_result:
    return os.stat_result((mode, 1, 1, 1, uid, 0, 4096, 0, 0, 0))


DIR_0700 = _st(stat.S_IFDIR | 0o700)
DIR_0755 = _st(stat.S_IFDIR | 0o755)
SHM = _st(stat.S_IFDIR | stat.S_ISVTX | 0o777)


@dataclass
class FakeProbes(doctor.Probes):
    """A healthy CPU host by default; tests change one field."""

    uid: int = 0
    cap_eff: int | None = ALL_CAPS
    cap_last: int | None = 40
    criu: str | None = CRIU
    criu_version: str = "4.2.1"
    criu_check: tuple[int, str] = (0, "Looks good.\n")
    features: dict = field(default_factory=dict)  # name -> (rc, out); default supported
    io_uring: str | None = "0\n"
    kernel: str = "6.18.0"
    libc: str = "glibc 2.36"
    stats: dict = field(default_factory=lambda: {"/var/lib/vllm-snapshot": DIR_0700, "/var/lib": DIR_0755,
                                                 "/var": DIR_0755, "/": DIR_0755, "/dev/shm": SHM})
    free: dict = field(default_factory=lambda: {"/var/lib/vllm-snapshot": 100 << 30, "/dev/shm": 8 << 30})
    path: dict = field(default_factory=lambda: {"unshare": "/usr/bin/unshare", "mount": "/usr/bin/mount",
                                                "tar": "/usr/bin/tar", "ip": "/usr/sbin/ip"})
    vllm: str = "0.32.0"
    import_errors: dict = field(default_factory=dict)
    gpu_host: bool = False
    gpu_list: list | None = None
    gpu_error: str | None = None
    files: set = field(default_factory=set)
    helper: tuple[int, str] = (0, "usage: cuda-checkpoint --action {lock,checkpoint,restore,unlock} --pid PID\n")
    ran: list = field(default_factory=list)
    left: list = field(default_factory=list)
    partials: list = field(default_factory=list)
    user: object = field(default_factory=lambda: privilege.User("vllm-snapshot", 990, 990, (990,),
                                                                "/var/lib/vllm-snapshot-engine"))
    denied: list = field(default_factory=list)  # paths the engine user cannot use
    user_writable: list = field(default_factory=list)  # paths it can write
    environ: dict = field(default_factory=dict)
    mounts: str = ("22 1 254:0 / / rw - ext4 /dev/vda rw\n"
                   "30 22 7:0 / /mnt/x rw - ext4 /dev/loop0 rw\n"
                   "31 22 0:40 / /sys/fs/bpf rw - bpf bpf rw\n")

    def euid(self) -> int:
        return self.uid

    def read_text(self, path: str) -> str | None:
        if path == "/proc/self/status":
            return None if self.cap_eff is None else f"Name:\tx\nCapEff:\t{self.cap_eff:016x}\n"
        if path == "/proc/sys/kernel/cap_last_cap":
            return None if self.cap_last is None else f"{self.cap_last}\n"
        if path == doctor.IO_URING_SYSCTL:
            return self.io_uring
        return getattr(self, "texts", {}).get(path)

    def find_criu(self) -> str | None:
        return self.criu

    def run(self, argv: Sequence[str], timeout: float) -> tuple[int, str]:
        self.ran.append(list(argv))
        if argv[0] == self.criu:
            if argv[1:] == ["--version"]:
                return 0, f"Version: {self.criu_version}\n"
            if argv[1:] == ["check"]:
                return self.criu_check
            if argv[1:3] == ["check", "--feature"]:
                return self.features.get(argv[3], (0, f"{argv[3]} is supported\n"))
        if "vllm_snapshot.checkpoint.cuda_checkpoint" in argv:
            return self.helper
        return 127, f"unexpected {argv}"

    def kernel_release(self) -> str:
        return self.kernel

    def glibc(self) -> str:
        return self.libc

    def lstat(self, path: str) -> os.stat_result | None:
        return self.stats.get(path)

    def stat(self, path: str) -> os.stat_result | None:
        return self.stats.get(path)

    def free_bytes(self, path: str) -> int | None:
        return self.free.get(path)

    def writable(self, path: str) -> bool:
        return True

    def which(self, name: str) -> str | None:
        return self.path.get(name)

    def vllm_version(self) -> str:
        return self.vllm

    def import_error(self, module: str) -> str | None:
        return self.import_errors.get(module)

    def is_dir(self, path: str) -> bool:
        return self.gpu_host and path == doctor.PROC_GPUS

    def is_file(self, path: str) -> bool:
        return path in self.files

    def gpus(self) -> list:
        if self.gpu_error:
            raise EnvironmentProblem(self.gpu_error, hint="check the NVIDIA driver")
        return self.gpu_list or []

    def env(self, name: str) -> str | None:
        return self.environ.get(name)

    def mountinfo(self) -> str:
        return self.mounts

    def leftovers(self, snapshot_root: str) -> list[str]:
        return list(self.left)

    def partial_pulls(self, snapshot_root: str) -> list[PartialPull]:
        return list(self.partials)

    def engine_user(self, name: str):
        return self.user

    def user_access(self, user, read: Sequence[str] = (), reach: Sequence[str] = (), nowrite: Sequence[str] = (),
                    write: Sequence[str] = ()) -> list[str]:
        self.ran.append(["user_access", user.name, tuple(read), tuple(reach), tuple(nowrite), tuple(write)])
        return [x for x in self.denied if x in (*read, *reach, *write)] + \
            [f"can write {x}" for x in nowrite if x in self.user_writable]

    def python_paths(self) -> dict[str, str]:
        return getattr(self, "py_paths", None) or {"Python environment": "/venv", "vllm package": "/venv/lib/vllm"}


def _by_name(checks) -> dict[str, Check]:
    names = [c.name for c in checks]
    assert len(names) == len(set(names)), names
    return {c.name: c for c in checks}


def _failed_errors(checks) -> list[str]:
    return [c.name for c in checks if not c.ok and c.severity == "error"]


def test_healthy_cpu_host():
    p = FakeProbes()
    checks = doctor.run_checks(p)
    by = _by_name(checks)
    assert _failed_errors(checks) == []
    assert doctor.exit_code(checks) == 0
    for name in ("root", "criu", "criu-check", "criu-feature:ns_pid", "criu-feature:fdinfo_lock", "io_uring",
                 "kernel", "glibc", "snapshot-root", "snapshot-root-space", "dev-shm", "program:unshare",
                 "program:mount", "program:tar", "program:ip", "vllm", "pycriu", "gpu"):
        assert name in by and by[name].ok, (name, by.get(name))
    assert "4.2.1" in by["criu"].detail
    assert "0.32.0" in by["vllm"].detail
    assert by["gpu"].severity == "info"
    assert "capabilities" not in by  # nothing recommended is missing
    # the exact feature names CRIU 4.2.1 accepts
    asked = [a[3] for a in p.ran if a[1:3] == ["check", "--feature"]]
    assert set(asked) == {"ns_pid", "clone3_set_tid", "move_mount_set_group", "fdinfo_lock", "kcmp_epoll"}


def test_not_root():
    checks = doctor.run_checks(FakeProbes(uid=1000, cap_eff=0))
    root = _by_name(checks)["root"]
    assert not root.ok and root.severity == "error"
    assert "uid 1000" in root.detail and "sudo" in root.remedy
    assert doctor.exit_code(checks) == 11


def test_not_root_leaves_what_only_root_can_check_unchecked_instead_of_failed():
    # a plain user's doctor said `criu check` features were "not supported" (remedy: a newer
    # kernel), the engine user's checks "could not run: Operation not permitted" and "no
    # leftovers" of a store it cannot read: none of them is a fact about the host
    p = FakeProbes(uid=1000, cap_eff=0, criu_check=(1, "setcap cap_checkpoint_restore+eip criu\n"),
                   features={f: (1, "setcap cap_checkpoint_restore+eip criu\n") for f, _s, _w in doctor.CRIU_FEATURES},
                   left=["/dev/shm/vllm-snapshot-stage-99-x"])
    checks = doctor.run_checks(p)
    by = _by_name(checks)
    assert _failed_errors(checks) == ["root"] and doctor.exit_code(checks) == 11
    unchecked = ["criu-check", *(f"criu-feature:{f}" for f, _s, _w in doctor.CRIU_FEATURES),
                 "leftovers", "engine-user:python", "engine-user:home"]
    for name in unchecked:
        c = by[name]
        assert (c.ok, c.severity) == (False, "info"), c
        assert c.detail.startswith("not checked as uid 1000: ") and c.detail.endswith(" needs root"), c
        assert c.remedy == "run `sudo vllm-snapshot doctor` to check it", c
    assert not [a for a in p.ran if a[0] == "user_access" or a[1:2] == ["check"]], p.ran
    assert by["engine-user"].ok and by["criu"].ok  # what a plain user can see is still checked


def test_root_without_required_capability_names_it():
    eff = ALL_CAPS & ~(1 << 21)  # no CAP_SYS_ADMIN
    root = _by_name(doctor.run_checks(FakeProbes(cap_eff=eff)))["root"]
    assert not root.ok and "CAP_SYS_ADMIN" in root.detail


def test_checkpoint_restore_not_required_on_kernels_without_it():
    eff = ALL_CAPS & ~(1 << 40)
    assert _by_name(doctor.run_checks(FakeProbes(cap_eff=eff, cap_last=39)))["root"].ok
    root = _by_name(doctor.run_checks(FakeProbes(cap_eff=eff, cap_last=40)))["root"]
    assert not root.ok and "CAP_CHECKPOINT_RESTORE" in root.detail


def test_missing_recommended_capability_is_a_warning():
    checks = doctor.run_checks(FakeProbes(cap_eff=ALL_CAPS & ~(1 << 12)))  # no CAP_NET_ADMIN
    caps = _by_name(checks)["capabilities"]
    assert not caps.ok and caps.severity == "warning" and "CAP_NET_ADMIN" in caps.detail
    assert doctor.exit_code(checks) == 0


def test_missing_sys_resource_alone_is_a_passing_note():
    """Root in many containers lacks CAP_SYS_RESOURCE; dumps and restores work around it (the
    dump's real ids, PR_SET_MM_MAP), so doctor says so instead of a warning on every run."""
    checks = doctor.run_checks(FakeProbes(cap_eff=ALL_CAPS & ~(1 << 24)))
    caps = _by_name(checks)["capabilities"]
    assert caps.ok and "CAP_SYS_RESOURCE" in caps.detail and "handled" in caps.detail
    both = _by_name(doctor.run_checks(FakeProbes(cap_eff=ALL_CAPS & ~(1 << 24) & ~(1 << 12))))["capabilities"]
    assert not both.ok and "CAP_NET_ADMIN" in both.detail and "CAP_SYS_RESOURCE" in both.detail
    assert "CAP_SYS_RESOURCE (rlimits" not in both.detail  # not among those that may fail


def test_criu_missing():
    checks = doctor.run_checks(FakeProbes(criu=None))
    by = _by_name(checks)
    assert not by["criu"].ok and by["criu"].severity == "error" and "not found" in by["criu"].detail
    assert not any(n.startswith("criu-check") or n.startswith("criu-feature") for n in by)
    assert doctor.exit_code(checks) == 11


def test_criu_too_old():
    checks = doctor.run_checks(FakeProbes(criu_version="4.1.1"))
    c = _by_name(checks)["criu"]
    assert not c.ok and "4.1.1" in c.detail and "4.2" in c.detail
    assert doctor.exit_code(checks) == 11


def test_criu_check_failing():
    checks = doctor.run_checks(FakeProbes(criu_check=(1, "Error (criu/cr-check.c:1): bad\nLooks bad.\n")))
    c = _by_name(checks)["criu-check"]
    assert not c.ok and c.severity == "error" and "exited 1" in c.detail and "Looks bad." in c.detail
    assert _failed_errors(checks) == ["criu-check"]
    assert doctor.exit_code(checks) == 11


def test_missing_features_by_severity():
    checks = doctor.run_checks(FakeProbes(features={"clone3_set_tid": (1, "")}))
    c = _by_name(checks)["criu-feature:clone3_set_tid"]
    assert not c.ok and c.severity == "warning"
    assert doctor.exit_code(checks) == 0
    checks = doctor.run_checks(FakeProbes(features={"ns_pid": (1, "")}))
    assert _failed_errors(checks) == ["criu-feature:ns_pid"]
    assert doctor.exit_code(checks) == 11


@pytest.mark.parametrize("value, expect, remedy", [
    ("0\n", "allowed for all", True),
    ("1\n", "CAP_SYS_ADMIN", True),
    ("2\n", "disabled for all", False),
    (None, "absent", False),  # no sysctl to set on kernels < 6.6
])
def test_io_uring_setting_is_informational(value, expect, remedy):
    checks = doctor.run_checks(FakeProbes(io_uring=value))
    c = _by_name(checks)["io_uring"]
    assert c.ok and c.severity == "info"
    assert expect in c.detail and "UV_USE_IO_URING=0" in c.detail
    assert bool(c.remedy) is remedy
    assert doctor.exit_code(checks) == 0


def test_old_kernel_warns():
    c = _by_name(doctor.run_checks(FakeProbes(kernel="5.4.0-150-generic")))["kernel"]
    assert not c.ok and c.severity == "warning"


def test_snapshot_root_missing_is_a_warning():
    p = FakeProbes()
    del p.stats["/var/lib/vllm-snapshot"]
    p.free["/var/lib"] = 50 << 30
    checks = doctor.run_checks(p)
    by = _by_name(checks)
    assert not by["snapshot-root"].ok and by["snapshot-root"].severity == "warning"
    assert "install -d -m 0700" in by["snapshot-root"].remedy
    assert by["snapshot-root-space"].ok and "/var/lib" in by["snapshot-root-space"].detail
    assert doctor.exit_code(checks) == 0


@pytest.mark.parametrize("change, words", [
    ({"/var/lib/vllm-snapshot": _st(stat.S_IFDIR | 0o777)}, "0777"),
    ({"/var/lib/vllm-snapshot": _st(stat.S_IFDIR | 0o700, uid=1234)}, "uid 1234"),
    ({"/var/lib/vllm-snapshot": _st(stat.S_IFLNK | 0o777)}, "symlink"),
    ({"/var/lib": _st(stat.S_IFDIR | 0o777)}, "writable by group/others"),
])
def test_unsafe_snapshot_root_is_an_error(change, words):
    p = FakeProbes()
    p.stats.update(change)
    checks = doctor.run_checks(p)
    c = _by_name(checks)["snapshot-root"]
    assert not c.ok and c.severity == "error" and words in c.detail
    assert doctor.exit_code(checks) == 11


def test_sticky_root_parent_is_fine():
    p = FakeProbes()
    p.stats["/var/lib"] = _st(stat.S_IFDIR | stat.S_ISVTX | 0o777)
    assert _by_name(doctor.run_checks(p))["snapshot-root"].ok


def test_low_space_warns():
    p = FakeProbes()
    p.free.update({"/var/lib/vllm-snapshot": 1 << 20, "/dev/shm": 1 << 20})
    checks = doctor.run_checks(p)
    by = _by_name(checks)
    assert not by["snapshot-root-space"].ok and by["snapshot-root-space"].severity == "warning"
    assert not by["dev-shm"].ok and by["dev-shm"].severity == "warning"
    assert doctor.exit_code(checks) == 0


def test_dev_shm_missing_is_an_error():
    p = FakeProbes()
    del p.stats["/dev/shm"]
    c = _by_name(doctor.run_checks(p))["dev-shm"]
    assert not c.ok and c.severity == "error"


def test_missing_program():
    p = FakeProbes()
    del p.path["tar"]
    checks = doctor.run_checks(p)
    assert _failed_errors(checks) == ["program:tar"]


def test_missing_ip_names_iproute2_and_why():
    """CRIU runs `ip addr|route save/restore` for the engine's own network namespace."""
    p = FakeProbes()
    del p.path["ip"]
    checks = doctor.run_checks(p)
    assert _failed_errors(checks) == ["program:ip"]
    c = _by_name(checks)["program:ip"]
    assert "network namespace" in c.detail and c.remedy == "apt install iproute2"
    assert doctor.exit_code(checks) != 0


def test_vllm_and_pycriu():
    checks = doctor.run_checks(FakeProbes(vllm="absent", import_errors={"pycriu": "ModuleNotFoundError: x"}))
    assert _failed_errors(checks) == ["vllm", "pycriu"]
    c = _by_name(doctor.run_checks(FakeProbes(vllm="unknown")))["vllm"]
    assert not c.ok and c.severity == "warning"


GPU = GpuInfo(driver="580.95.05", name="NVIDIA H200", uuid="GPU-1234", memory_used_bytes=0,
              memory_free_bytes=140 << 30)
PLUGIN = "/opt/criu/plugins/cuda/cuda_plugin.so"  # next to the source-built CRIU binary


def test_gpu_host_with_plugin_and_helper():
    p = FakeProbes(gpu_host=True, gpu_list=[GPU], files={PLUGIN})
    checks = doctor.run_checks(p)
    by = _by_name(checks)
    for name in ("gpu", "gpu-driver", "criu-cuda-plugin", "cuda-checkpoint"):
        assert by[name].ok and by[name].severity == "error", by[name]
    assert "NVIDIA H200" in by["gpu"].detail and "580.95.05" in by["gpu-driver"].detail
    assert PLUGIN in by["criu-cuda-plugin"].detail
    assert doctor.exit_code(checks) == 0
    helper_runs = [a for a in p.ran if "vllm_snapshot.checkpoint.cuda_checkpoint" in a]
    assert helper_runs and helper_runs[0][-1] == "-h"


def test_gpu_host_plugin_from_distro_path():
    p = FakeProbes(gpu_host=True, gpu_list=[GPU], files={"/usr/lib/criu/cuda_plugin.so"}, criu="/usr/sbin/criu")
    assert _by_name(doctor.run_checks(p))["criu-cuda-plugin"].ok


def test_gpu_host_plugin_of_another_criu_build_is_refused():
    # the distro's plugin must not be loaded into a source-built CRIU (it reads CRIU's opts struct)
    p = FakeProbes(gpu_host=True, gpu_list=[GPU], files={"/usr/lib/criu/cuda_plugin.so"})
    c = _by_name(doctor.run_checks(p))["criu-cuda-plugin"]
    assert not c.ok and "another CRIU" in c.detail and "/usr/lib/criu/cuda_plugin.so" in c.detail


def test_gpu_host_config_file_libdir_is_reported():
    p = FakeProbes(gpu_host=True, gpu_list=[GPU], files={PLUGIN})
    p.texts = {"/etc/criu/default.conf": "# site\nlibdir /opt/other-plugins\ntcp-established\n"}
    c = _by_name(doctor.run_checks(p))["criu-config-libdir"]
    assert not c.ok and c.severity == "error" and "/etc/criu/default.conf sets libdir /opt/other-plugins" in c.detail
    p.texts = {"/etc/criu/default.conf": "libdir /opt/criu/plugins/cuda\n"}  # ours: fine
    assert "criu-config-libdir" not in _by_name(doctor.run_checks(p))


def test_gpu_host_without_plugin():
    checks = doctor.run_checks(FakeProbes(gpu_host=True, gpu_list=[GPU]))
    c = _by_name(checks)["criu-cuda-plugin"]
    assert not c.ok and c.severity == "error" and PLUGIN in c.detail and "setup.sh" in c.remedy
    assert doctor.exit_code(checks) == 11


def test_gpu_host_old_driver():
    old = dataclasses.replace(GPU, driver="550.54.15")
    c = _by_name(doctor.run_checks(FakeProbes(gpu_host=True, gpu_list=[old], files={PLUGIN})))["gpu-driver"]
    assert not c.ok and "570" in c.detail  # the checkpoint driver API (r570), not the plugin's r555
    new = dataclasses.replace(GPU, driver="570.86.10")
    assert _by_name(doctor.run_checks(FakeProbes(gpu_host=True, gpu_list=[new], files={PLUGIN})))["gpu-driver"].ok


def test_gpu_host_nvidia_smi_broken():
    checks = doctor.run_checks(FakeProbes(gpu_host=True, gpu_error="nvidia-smi failed (exit 9)", files={PLUGIN}))
    c = _by_name(checks)["gpu"]
    assert not c.ok and "nvidia-smi failed" in c.detail
    assert doctor.exit_code(checks) == 11


def test_gpu_host_without_cuda_bindings_or_broken_helper():
    p = FakeProbes(gpu_host=True, gpu_list=[GPU], files={PLUGIN},
                   import_errors={"cuda.bindings.driver": "ModuleNotFoundError: No module named 'cuda'"})
    c = _by_name(doctor.run_checks(p))["cuda-checkpoint"]
    assert not c.ok and "cuda-bindings" in c.detail
    p = FakeProbes(gpu_host=True, gpu_list=[GPU], files={PLUGIN}, helper=(1, "Traceback ...\nImportError: x"))
    c = _by_name(doctor.run_checks(p))["cuda-checkpoint"]
    assert not c.ok and "exited 1" in c.detail
    p = FakeProbes(gpu_host=True, gpu_list=[GPU], files={PLUGIN},
                   helper=(3, "cuda-checkpoint: unavailable: cuInit: CUDA_ERROR_NO_DEVICE (no CUDA-capable device)"))
    c = _by_name(doctor.run_checks(p))["cuda-checkpoint"]
    assert not c.ok and "exited 3" in c.detail and "CUDA_ERROR_NO_DEVICE" in c.detail
    # a driver older than the checkpoint API: -h without --action
    p = FakeProbes(gpu_host=True, gpu_list=[GPU], files={PLUGIN},
                   helper=(0, "usage: cuda-checkpoint -h\n... NOT AVAILABLE with this driver: driver API 12040\n"))
    c = _by_name(doctor.run_checks(p))["cuda-checkpoint"]
    assert not c.ok and "no checkpoint API" in c.detail and "570" in c.remedy


def test_vllm_other_than_the_checked_release_warns():
    c = _by_name(doctor.run_checks(FakeProbes(vllm="0.33.1")))["vllm"]
    assert not c.ok and c.severity == "warning" and "0.32.0" in c.detail
    assert _by_name(doctor.run_checks(FakeProbes(vllm="0.32.0+cpu")))["vllm"].ok


# --- exit code, data shape, rendering ---------------------------------------------------------

@pytest.mark.parametrize("checks, code", [
    ([], 0),
    ([Check("a", True, "error", "")], 0),
    ([Check("a", False, "warning", ""), Check("b", False, "info", "")], 0),
    ([Check("a", True, "error", ""), Check("b", False, "error", "")], 11),
])
def test_exit_code(checks, code):
    assert doctor.exit_code(checks) == code


def test_exit_code_is_environment_problems():
    assert doctor.exit_code([Check("x", False, "error", "")]) == EnvironmentProblem.exit_code


def test_check_is_frozen_and_serializable():
    c = Check("a", False, "error", "d", "r")
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.ok = True  # type: ignore[misc]
    from vllm_snapshot.report.results import DoctorReport

    j = DoctorReport([c], doctor.exit_code([c])).to_json()
    assert j == {"ok": False, "exit_code": 11,
                 "checks": [{"name": "a", "ok": False, "severity": "error", "detail": "d", "remedy": "r"}]}


def test_doctor_command_table_and_exit_code(monkeypatch, capsys):
    fake = [Check("root", True, "error", "root"), Check("criu", False, "error", "CRIU not found", "install it"),
            Check("snapshot-root", False, "warning", "missing", "mkdir")]
    monkeypatch.setattr(doctor, "run_checks", lambda probes=None, snapshot_root=None: fake)
    assert cli.main(["doctor"]) == 11
    out = capsys.readouterr().out
    assert "✗" in out and "✓" in out and "!" in out and "CRIU not found" in out and "install it" in out
    assert cli.main(["doctor", "--json"]) == 11
    j = json.loads(capsys.readouterr().out)
    assert j["schema_version"] == 1 and j["exit_code"] == 11 and len(j["checks"]) == 3


# --- this machine ----------------------------------------------------------------------------

def test_real_probes_run_without_crashing():
    checks = doctor.run_checks()
    _by_name(checks)
    assert checks and all(isinstance(c, Check) and c.severity in ("error", "warning", "info") for c in checks)
    assert doctor.exit_code(checks) in (0, 11)


def test_doctor_json_subprocess():
    from conftest import _missing

    p = subprocess.run([sys.executable, "-m", "vllm_snapshot", "doctor", "--json"], capture_output=True,
                       text=True, timeout=120, cwd=ROOT)
    j = json.loads(p.stdout)
    assert j["schema_version"] == 1
    assert j["exit_code"] == p.returncode
    assert {"name", "ok", "severity", "detail", "remedy"} == set(j["checks"][0])
    if _missing() is None:  # root, CRIU >= 4.2, vLLM, pycriu: this host can create/restore
        failed = [c for c in j["checks"] if not c["ok"] and c["severity"] == "error"]
        assert p.returncode == 0, failed
    else:
        assert p.returncode in (0, 11), p.stderr


def test_leftovers_of_killed_commands_are_reported():
    ok = _by_name(doctor.run_checks(FakeProbes()))["leftovers"]
    assert ok.ok
    c = _by_name(doctor.run_checks(FakeProbes(left=["/dev/shm/vllm-snapshot-stage-99-x"])))["leftovers"]
    assert not c.ok and c.severity == "warning" and "vllm-snapshot-stage-99-x" in c.detail and "prune" in c.remedy


def test_partial_pulls_kept_for_resuming_are_named_with_their_size_but_fail_nothing():
    # a trial: an interrupted pull's 471 MB .pull-<digest> showed nowhere
    part = {"path": "/var/lib/vllm-snapshot/.pull-ab12", "bytes": 471 << 20, "age_s": 300.0, "live": False}
    c = _by_name(doctor.run_checks(FakeProbes(partials=[part])))["leftovers"]
    assert c.ok, c
    assert ("kept the partial pull /var/lib/vllm-snapshot/.pull-ab12 (471.0 MiB, last written 5 min ago) for "
            "resuming") in c.detail and "`rm -r /var/lib/vllm-snapshot/.pull-ab12` removes it" in c.detail
    c = _by_name(doctor.run_checks(FakeProbes(partials=[part], left=["/dev/shm/vllm-snapshot-stage-99-x"])))["leftovers"]
    assert not c.ok and ".pull-ab12 (471.0 MiB" in c.detail


def test_one_empty_engine_cgroup_in_ten_hierarchies_is_one_leftover_that_holds_nothing():
    # a trial: "10 leftover(s) of killed commands hold disk or RAM" for ONE empty cgroup
    leaves = [f"/sys/fs/cgroup/{h}/vllm-snapshot/6da7c6f1-4242" for h in
              ("memory", "cpu,cpuacct", "pids", "blkio", "devices", "freezer", "net_cls", "perf_event", "hugetlb",
               "unified")]
    left = doctor.empty_cgroups(leaves)
    assert left == ["empty engine cgroup /vllm-snapshot/6da7c6f1-4242 (holds no process and no memory; "
                    "in 10 hierarchies)"]
    c = _by_name(doctor.run_checks(FakeProbes(left=left)))["leftovers"]
    assert c.detail.startswith("1 leftover(s) ") and "hold disk or RAM" not in c.detail, c.detail
    assert doctor.empty_cgroups(leaves[:1] + ["/sys/fs/cgroup/memory/vllm-snapshot/b"]) == [
        "empty engine cgroup /vllm-snapshot/6da7c6f1-4242 (holds no process and no memory)",
        "empty engine cgroup /vllm-snapshot/b (holds no process and no memory)"]


def test_mounts_are_listed_with_what_the_engine_namespace_does_with_them():
    c = _by_name(doctor.run_checks(FakeProbes()))
    assert "/mnt/x (ext4)" in c["mounts-detached"].detail and "/sys/fs/bpf (bpf)" in c["mounts-detached"].detail
    assert "mounts-refused" not in c
    fuse = FakeProbes(mounts="22 1 254:0 / / rw - ext4 /dev/vda rw\n40 22 0:50 / /root rw - fuse.sshfs h:/ rw\n")
    c = _by_name(doctor.run_checks(fuse))
    assert not c["mounts-refused"].ok and "/root (fuse.sshfs)" in c["mounts-refused"].detail


def test_mounts_show_the_driver_directory_on_ld_library_path_as_external(monkeypatch):
    from helpers import python_outside_usr

    python_outside_usr(monkeypatch)
    gke = "22 1 254:0 / / rw - ext4 /dev/vda rw\n40 22 254:1 /home/kubernetes/bin/nvidia /usr/local/nvidia ro - ext4 /dev/vdb rw\n"
    c = _by_name(doctor.run_checks(FakeProbes(mounts=gke, environ={"LD_LIBRARY_PATH": "/usr/local/nvidia/lib64"})))
    assert "/usr/local/nvidia (ext4): holds /usr/local/nvidia/lib64" in c["mounts-external"].detail
    c = _by_name(doctor.run_checks(FakeProbes(mounts=gke)))
    assert "/usr/local/nvidia (ext4)" in c["mounts-detached"].detail


def test_engine_user_checks():
    by = _by_name(doctor.run_checks(FakeProbes()))
    assert by["engine-user"].ok and "uid 990" in by["engine-user"].detail
    assert by["engine-user:python"].ok and by["engine-user:home"].ok
    assert "engine-user:models" not in by  # no model store on this fake host

    checks = doctor.run_checks(FakeProbes(user=None))
    by = _by_name(checks)
    assert not by["engine-user"].ok and "useradd --system" in by["engine-user"].remedy
    assert "engine-user" in _failed_errors(checks) and doctor.exit_code(checks) == 11

    p = FakeProbes(denied=["/venv/lib/vllm", "/var/lib/vllm-snapshot-engine"], user_writable=["/venv"])
    by = _by_name(doctor.run_checks(p))
    assert not by["engine-user:python"].ok and "/venv/lib/vllm" in by["engine-user:python"].detail
    assert "can write /venv" in by["engine-user:python"].detail
    assert not by["engine-user:home"].ok and "install -d -o vllm-snapshot" in by["engine-user:home"].remedy
    root = FakeProbes(user=privilege.User("vllm-snapshot", 0, 0, (0,), "/root"))
    assert not _by_name(doctor.run_checks(root))["engine-user"].ok


def test_engine_user_reads_the_model_store():
    @dataclass
    class WithStore(FakeProbes):
        def is_dir(self, path: str) -> bool:
            return path == "/var/cache/vllm-snapshot/models"

    by = _by_name(doctor.run_checks(WithStore()))
    assert by["engine-user:models"].ok
    by = _by_name(doctor.run_checks(WithStore(denied=["/var/cache/vllm-snapshot/models"])))
    c = by["engine-user:models"]
    assert not c.ok and c.severity == "warning" and "setfacl" in c.remedy


def test_an_interpreter_other_users_cannot_reach_is_a_warning_naming_it_and_make_setup():
    # a trial: doctor as root said "ready" with the venv on /root/.pyenv's Python: no other user
    # could start the CLI (inspect, list and doctor are meant to work for every user)
    exe = "/root/.pyenv/versions/3.11.9/bin/python3.11"
    p = FakeProbes()
    p.py_paths = {"Python interpreter": exe, "standard library": "/root/.pyenv/versions/3.11.9/lib/python3.11",
                  "Python environment": "/var/cache/vllm-snapshot/venv", "vllm_snapshot package": "/srv/vs/vllm_snapshot"}
    exe_file = _st(stat.S_IFREG | 0o755)
    p.stats.update({"/root": DIR_0700, "/root/.pyenv": DIR_0755, "/root/.pyenv/versions": DIR_0755,
                    "/root/.pyenv/versions/3.11.9": DIR_0755, "/root/.pyenv/versions/3.11.9/bin": DIR_0755,
                    "/root/.pyenv/versions/3.11.9/lib": DIR_0755, "/root/.pyenv/versions/3.11.9/lib/python3.11": DIR_0755,
                    exe: exe_file, "/var/cache": DIR_0755, "/var/cache/vllm-snapshot": DIR_0755,
                    "/var/cache/vllm-snapshot/venv": DIR_0755, "/srv": DIR_0755, "/srv/vs": DIR_0755,
                    "/srv/vs/vllm_snapshot": DIR_0755})
    checks = doctor.run_checks(p)
    c = _by_name(checks)["python-for-all-users"]
    assert (c.ok, c.severity) == (False, "warning"), c
    assert exe in c.detail and "lies below /root (mode 0700" in c.detail and c.remedy.startswith("make setup"), c
    assert doctor.exit_code(checks) == 0  # root can still work: not an error
    p.stats["/root"] = _st(stat.S_IFDIR | 0o711)  # traversable: every user can run it
    assert _by_name(doctor.run_checks(p))["python-for-all-users"].ok
    p.stats["/srv/vs"] = DIR_0700  # the checkout out of reach: clone it elsewhere
    c = _by_name(doctor.run_checks(p))["python-for-all-users"]
    assert not c.ok and "/srv/vs/vllm_snapshot lies below /srv/vs" in c.detail and "/opt" in c.remedy, c
    p.stats["/srv/vs"] = DIR_0755
    p.stats[exe] = _st(stat.S_IFREG | 0o750)  # the program itself
    c = _by_name(doctor.run_checks(p))["python-for-all-users"]
    assert not c.ok and "has mode 0750: other users lack x" in c.detail, c


def test_the_model_store_is_where_paths_says(monkeypatch):
    # doctor asks vllm_snapshot.paths (the one owner of default paths), with its probe's env
    from vllm_snapshot import paths

    @dataclass
    class WithStore(FakeProbes):
        def is_dir(self, path: str) -> bool:
            return path in ("/srv/cache/models", "/srv/env-cache/models")

    monkeypatch.setattr(paths, "DEFAULT_CACHE", Path("/srv/cache"))
    assert "can read every model under /srv/cache/models" in _by_name(doctor.run_checks(WithStore()))["engine-user:models"].detail
    by = _by_name(doctor.run_checks(WithStore(environ={"VLLM_SNAPSHOT_CACHE": "/srv/env-cache"})))
    assert "/srv/env-cache/models" in by["engine-user:models"].detail


def test_ksm_is_reported_for_merge_pages():
    p = FakeProbes()
    p.texts = {"/sys/kernel/mm/ksm/run": "1\n", "/sys/kernel/mm/ksm/pages_to_scan": "5000\n",
               "/sys/kernel/mm/ksm/sleep_millisecs": "20\n"}
    c = _by_name(doctor.run_checks(p))["ksm"]
    assert c.ok and c.severity == "info" and "KSM runs (run=1, pages_to_scan=5000, sleep_millisecs=20)" in c.detail
    p.texts = {"/sys/kernel/mm/ksm/run": "0\n"}
    c = _by_name(doctor.run_checks(p))["ksm"]
    assert "KSM is not running (run=0)" in c.detail and "nothing is merged" in c.detail
    assert "echo 1 > /sys/kernel/mm/ksm/run" in c.remedy and "security" in c.remedy
    p.texts = {}
    assert "this kernel has no KSM" in _by_name(doctor.run_checks(p))["ksm"].detail
