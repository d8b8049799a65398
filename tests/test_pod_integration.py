"""docs/operations.md's pod pattern under a real pod runtime (issue 40): Debian 12's podman 4.3
``podman kube play`` of docs/k8s/agent-pod.yaml -- an init container pulls the signed
snapshot from a loopback registry into the node's store, the agent container restores it and
serves; the pod is ready when /health answers, which it does only after the oracle matched.

The image is built here with no download (tests/pod_image.py: the cached bare Debian root plus
this host's package files); the snapshot is made by a "build node", a privileged container of
the same image (``podman run``: create, then push --sign-key), because CRIU restores a tree
into the same files at the same paths it had at create.

podman runs with a storage, run and tmp directory of its own under the test's temp dir, and a
containers.conf of its own (``CONTAINERS_CONF``): nothing of the host's podman state is read
or changed, and every pod, container and image is removed at the end (``podman system reset``
on that storage). What this machine needs of that configuration, each with the error without
it (docs/operations.md "Kubernetes", "Tried under podman"):

- ``runtime = "runc"``: crun 1.8 refuses this host's hybrid cgroup layout ("crun: cgroups in
  hybrid mode not supported, drop all controllers from cgroupv2");
- ``default_ulimits``: ``nofile`` at this process's hard limit, ``nproc`` at most 32768: by
  default a root container asks for more than the hard limits podman runs the runtime with
  (podman lowers its own hard ``nproc`` to 32768), and raising a hard limit needs
  CAP_SYS_RESOURCE, which root lacks on this VM ("crun: setrlimit `RLIMIT_NPROC`: Operation
  not permitted")."""

from __future__ import annotations

import json
import os
import resource
import shutil
import string
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import requests

from conftest import CACHE, ENGINE_ARGS, ROOT, TINY, cli, remove_tree
from pod_image import build_rootfs, import_image, remove_rootfs
from vllm_snapshot.dev.registry_server import RegistryServer
from test_bare_root import cached_root_tarball
from test_fleet import _keypair
from test_integration import free_port

pytestmark = pytest.mark.integration

POD_YAML = ROOT / "docs" / "k8s" / "agent-pod.yaml"
VENV_PYTHON = str(Path(sys.executable).parent / "python")  # the venv's, as the pod runs it
READY_TIMEOUT_S = 600


def _conf(d: Path) -> Path:
    hard_nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    hard_nproc = resource.getrlimit(resource.RLIMIT_NPROC)[1]
    nproc = min(hard_nproc, 32768) if hard_nproc != resource.RLIM_INFINITY else 32768
    f = d / "containers.conf"
    f.write_text("[containers]\n"
                 f'default_ulimits = ["nofile={hard_nofile}:{hard_nofile}", "nproc={nproc}:{nproc}"]\n'
                 "[engine]\n"
                 'runtime = "runc"\n')
    return f


class Podman:
    """podman with its own storage, run and tmp dirs and containers.conf, in a directory of its
    own under /var/tmp (podman refuses a run root longer than 50 characters: pytest's temp dirs
    are longer); :meth:`reset` removes everything it holds, and the directory."""

    def __init__(self):
        import tempfile

        self.base = base = Path(tempfile.mkdtemp(prefix="vsnap-pm-", dir="/var/tmp"))
        for sub in ("storage", "run", "tmp"):
            (base / sub).mkdir(parents=True, mode=0o700)
        self.env = {**os.environ, "CONTAINERS_CONF": str(_conf(base))}
        self.argv = ["podman", "--root", str(base / "storage"), "--runroot", str(base / "run"),
                     "--tmpdir", str(base / "tmp"), "--events-backend", "file"]

    def __call__(self, *args: str, timeout: float = 600, check: bool = True, **kw) -> subprocess.CompletedProcess:
        p = subprocess.run([*self.argv, *args], capture_output=True, text=True, timeout=timeout, env=self.env, **kw)
        if check and p.returncode != 0:
            raise AssertionError(f"podman {' '.join(args[:3])} exited {p.returncode}:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
        return p

    def reset(self) -> None:
        self("pod", "rm", "--all", "--force", "--time", "10", check=False, timeout=120)
        self("rm", "--all", "--force", "--time", "10", check=False, timeout=120)
        self("rmi", "--all", "--force", check=False, timeout=120)
        self("system", "reset", "--force", check=False, timeout=120)
        remove_tree(self.base)


def _private(d: Path) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    os.chmod(d, 0o700)
    return d


def _mounts(store: Path) -> list[str]:
    """The build node's volumes: the same as the pod's (docs/k8s/agent-pod.yaml)."""
    out = []
    for src, dst, ro in ((store, "/var/lib/vllm-snapshot", False), (CACHE, "/var/cache/vllm-snapshot", True),
                         (ROOT, ROOT, True), (Path("/var/lib/vllm-snapshot-engine"), "/var/lib/vllm-snapshot-engine",
                                                False), (Path("/etc/machine-id"), "/etc/machine-id", True)):
        out += ["-v", f"{src}:{dst}" + (":ro" if ro else "")]
    return out


def test_the_operations_pod_pulls_restores_and_becomes_ready_under_podman_kube_play(tmp_path):
    t0 = time.monotonic()
    times: dict[str, float] = {}
    pm = Podman()
    image = f"localhost/vllm-snapshot-agent:test-{os.getpid()}"
    reg = RegistryServer(tmp_path / "registry")
    pod = f"vsnap-agent-{os.getpid()}"
    rootfs = tmp_path / "rootfs"
    yaml_file = tmp_path / "pod.yaml"
    try:
        tarball, _built = cached_root_tarball()
        build_rootfs(tarball, rootfs)
        import_image(pm.argv, rootfs, image, pm.env)
        remove_rootfs(rootfs)
        times["image"] = time.monotonic() - t0
        fleet = _private(tmp_path / "fleet")
        key, pub = _keypair(_private(fleet / "key"), "fleet")
        (_private(fleet / "auth") / "config.json").write_text('{"auths": {}}\n')
        os.chmod(fleet / "auth" / "config.json", 0o600)
        artifact = f"{reg.host}/fleet/pod:v1"
        # the build node: create and push (signed) from a container of the same image
        build_store = _private(tmp_path / "build-store")
        shutil.copy(key, build_store / "fleet.key")
        py = [VENV_PYTHON, "-m", "vllm_snapshot"]
        script = " && ".join([
            " ".join([*py, "create", str(TINY), "--snapshot-dir", "/var/lib/vllm-snapshot/tiny", "-q", "--",
                      *ENGINE_ARGS]),
            " ".join([*py, "push", "/var/lib/vllm-snapshot/tiny", artifact, "--plain-http", "--sign-key",
                      "/var/lib/vllm-snapshot/fleet.key", "--json"])])
        t1 = time.monotonic()
        b = pm("run", "--rm", "--privileged", "--network", "host", *_mounts(build_store), "-w", str(ROOT), image,
               "sh", "-c", script, timeout=900)
        times["build_node"] = time.monotonic() - t1
        pushed = json.loads(b.stdout[b.stdout.index("{"):])
        # the pod, as docs/operations.md shows it
        store = _private(tmp_path / "node-store")
        port = free_port()
        yaml_file.write_text(string.Template(POD_YAML.read_text()).substitute(
            POD=pod, IMAGE=image, CHECKOUT=str(ROOT), PYTHON=VENV_PYTHON, ARTIFACT=artifact, PORT=str(port),
            STORE=str(store), FLEET=str(fleet)))
        t1 = time.monotonic()
        pm("kube", "play", str(yaml_file), timeout=600)
        deadline = time.monotonic() + READY_TIMEOUT_S
        ready = False
        while time.monotonic() < deadline and not ready:
            try:
                ready = requests.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200
            except requests.RequestException:
                state = pm("pod", "inspect", pod, "--format", "{{.State}}", check=False).stdout.strip()
                assert state not in ("Exited", "Dead", "Error"), (state, _logs(pm, pod))
                time.sleep(1)
        times["pod_ready"] = time.monotonic() - t1
        assert ready, f"the pod did not become ready in {READY_TIMEOUT_S} s:\n{_logs(pm, pod)}"
        # the init container pulled the signed artifact into the node's store (podman removes an
        # init container once it ran: its result is the store), the agent restored it
        listed = json.loads(cli("--root", str(store), "list", "--json", check=True).stdout)
        snaps = listed.get("snapshots", listed) if isinstance(listed, dict) else listed
        assert len(snaps) == 1, listed
        name = snaps[0]["name"] if isinstance(snaps[0], dict) else snaps[0]
        inspected = json.loads(cli("--root", str(store), "inspect", name, "--json", check=True).stdout)
        assert inspected["pulled"]["image"] == artifact and pushed["digest"] in json.dumps(inspected["pulled"]), \
            inspected["pulled"]
        agent = pm("logs", f"{pod}-agent", timeout=60)
        logs = agent.stdout + agent.stderr
        assert "replaying the oracle inside the engine: done" in logs, logs[-4000:]
        assert f"serving tiny-llama at http://127.0.0.1:{port}" in logs, logs[-4000:]
        print("agent healthcheck as podman made it from the readinessProbe: "
              + pm("inspect", f"{pod}-agent", "--format", "{{json .Config.Healthcheck}}", check=False).stdout.strip())
        body = {"model": "tiny-llama", "prompt": "Once upon a time", "max_tokens": 4, "temperature": 0.0,
                "logprobs": 2, "seed": 0}
        r = requests.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200 and len(r.json()["choices"][0]["logprobs"]["token_logprobs"]) == 4, r.text
        # every process of the agent container (the restore command and the engine tree CRIU put
        # back, in PID namespaces below the container's) goes with the pod
        top = psutil.Process(int(pm("inspect", f"{pod}-agent", "--format", "{{.State.Pid}}").stdout))
        procs = [top, *top.children(recursive=True)]
        assert len(procs) > 2, procs
        t1 = time.monotonic()
        pm("kube", "down", str(yaml_file), timeout=180)
        times["down"] = time.monotonic() - t1
        assert pm("pod", "exists", pod, check=False).returncode == 1
        _gone, alive = psutil.wait_procs(procs, timeout=30)
        assert not [p for p in alive if p.status() != psutil.STATUS_ZOMBIE], alive
    finally:
        if yaml_file.exists():
            pm("kube", "down", str(yaml_file), check=False, timeout=180)
        pm.reset()
        reg.stop()
        remove_rootfs(rootfs)
        _remove_stores(tmp_path / "build-store", tmp_path / "node-store")
    assert not pm.base.exists(), f"podman's storage {pm.base} was not removed"
    times["total"] = time.monotonic() - t0
    print("pod test seconds: " + ", ".join(f"{k} {v:.1f}" for k, v in times.items()))


def _remove_stores(*stores: Path) -> None:
    """Remove the stores the test made, their immutable weights files included."""
    for store in stores:
        remove_tree(store)


def _logs(pm: Podman, pod: str) -> str:
    out = []
    for c in (f"{pod}-pull", f"{pod}-agent"):
        p = pm("logs", c, check=False, timeout=60)
        out.append(f"--- {c} (rc {p.returncode})\n{p.stdout[-4000:]}{p.stderr[-4000:]}")
    return "\n".join(out)
