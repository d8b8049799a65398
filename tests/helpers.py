"""Shared builders for the unit tests (no vLLM, no CRIU, no network)."""

from __future__ import annotations

import inspect
import os
from pathlib import Path

import blake3

from vllm_snapshot.store import manifest
from vllm_snapshot.store.oracle import Oracle, TopLogprob


def b3(data: bytes) -> str:
    return blake3.blake3(data).hexdigest()


def make_oracle(**over) -> Oracle:
    base = dict(
        prompt="Once upon a time",
        token_id=11,
        text=",",
        logprob=-1.25,
        top_logprobs=(
            TopLogprob(token_id=11, logprob=-1.25),
            TopLogprob(token_id=13, logprob=-1.5),
            TopLogprob(token_id=290, logprob=-2.0),
            TopLogprob(token_id=6, logprob=-3.0),
            TopLogprob(token_id=1, logprob=-4.5),
        ),
    )
    base.update(over)
    return Oracle(**base)


def make_canary(**over) -> Oracle:
    """An HTTP canary's record (the canary prompt, another token than :func:`make_oracle`'s)."""
    from vllm_snapshot.engine.protocol import CANARY_PROMPT

    base = dict(prompt=CANARY_PROMPT, token_id=17, text=" there", logprob=-0.5,
                top_logprobs=(TopLogprob(token_id=17, logprob=-0.5), TopLogprob(token_id=11, logprob=-2.25)))
    base.update(over)
    return Oracle(**base)


#: The engine user of fake manifests and FakeWorld (uid/gid of a typical system user).
ENGINE_USER = manifest.EngineUser(name="vllm-snapshot", uid=990, gid=990, groups=(990,),
                                  home="/var/lib/vllm-snapshot-engine")


def manifest_fields(**over) -> dict:
    """Keyword arguments for a plausible, valid :class:`manifest.Manifest` (unsealed)."""
    pages = b"\x01" * 8192
    inv = b"inventory"
    fields = dict(
        schema_version=1,
        tool_version="0.1.0",
        created_at="2025-01-01T00:00:00+00:00",
        host={"vllm": "0.32.0", "torch": "2.13.0+cpu", "kernel": "6.18.0", "machine_id": "abc"},
        engine=manifest.EngineInfo(
            kind="cpu", sleep_level=0, engine_args=("--max-model-len", "512"),
            env_hashes={"VLLM_CPU_KVCACHE_SPACE": "0123456789abcdef"}, full_state_captured=True,
            user=ENGINE_USER),
        model=manifest.ModelIdentity(
            requested="/models/tiny", path="/models/tiny", served_name="tiny",
            files=(manifest.ModelFile(path="model.safetensors", size=100, blake3=b3(b"m"),
                                      mtime_ns=1, ctime_ns=2, inode=3, device=4),),
            total_bytes=100),
        oracle=make_oracle(),
        criu=manifest.CriuInfo(
            version="4.2.1", flags=("shell-job", "ext-unix-sk"), inherit={"control": "pipe:[123]"},
            pid_namespace=True, root_pid=4242, tree_pids=(4242, 4243), tree_commands=("python", "python"),
            dump_argv=("dump", "-t", "4242")),
        images=(
            manifest.ImageFile(name="inventory.img", raw_bytes=len(inv), stored_bytes=len(inv), blake3=b3(inv)),
            manifest.ImageFile(name="pages-1.img", raw_bytes=len(pages), stored_bytes=len(pages), blake3=b3(pages)),
        ),
        sizes={"raw": len(pages) + len(inv), "stored": len(pages) + len(inv), "model": 100},
        timings={"dump": 1.5, "pack": 0.25},
    )
    fields.update(over)
    return fields


def make_manifest(**over) -> manifest.Manifest:
    """A sealed, valid manifest."""
    return manifest.seal(manifest.Manifest(**manifest_fields(**over)))


def write_snapshot_dir(path: Path, m: manifest.Manifest | None = None) -> manifest.Manifest:
    """A private (0700) directory holding ``manifest.json`` of ``m`` (default: make_manifest())."""
    m = m or make_manifest()
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(path, 0o700)
    manifest.write_atomic(m, path)
    return m


def readable_by_engine(path) -> None:
    """Let the unprivileged engine user read ``path`` (a model a test made under a root-only
    temp dir): search permission (o+x, not read) on each of its ancestors below /tmp or /var/tmp,
    and ``a+rX`` on ``path`` and everything in it. Snapshot dirs beside it stay 0700."""
    import stat as _stat

    path = Path(path)
    for base in (Path("/tmp"), Path("/var/tmp")):
        if base in path.parents:
            for p in [q for q in path.parents if base in q.parents]:
                os.chmod(p, _stat.S_IMODE(os.stat(p).st_mode) | 0o001)
    for d, dirs, files in os.walk(path):
        os.chmod(d, _stat.S_IMODE(os.stat(d).st_mode) | 0o555)
        for f in files:
            fp = os.path.join(d, f)
            if not os.path.islink(fp):
                os.chmod(fp, _stat.S_IMODE(os.stat(fp).st_mode) | 0o444)


def stand_in(real, fake):
    """``fake``, checked to take exactly the parameters of ``real`` (names, kinds, which have a
    default), for ``monkeypatch.setattr(module, name, stand_in(module.name, fake))``: a double
    with another signature than the function it replaces fails here, not silently later.
    Raises AssertionError naming both signatures."""
    def shape(f):
        return [(p.name, p.kind, p.default is inspect.Parameter.empty) for p in inspect.signature(f).parameters.values()]

    assert shape(fake) == shape(real), f"{fake.__name__}{inspect.signature(fake)} does not stand for {real.__qualname__}{inspect.signature(real)}"
    return fake


def python_outside_usr(monkeypatch) -> None:
    """Make this Python's prefixes and executable (which the engine needs:
    :func:`vllm_snapshot.engine.mounts.needed_paths`) /opt/py, for mount tests whose expected
    answers assume a Python outside /usr: with Debian's /usr/bin/python3.11 every mount under
    /usr is needed for that reason alone."""
    import sys

    for name in ("prefix", "base_prefix", "exec_prefix"):
        monkeypatch.setattr(sys, name, "/opt/py")
    monkeypatch.setattr(sys, "executable", "/opt/py/bin/python3.11")


def throwaway_user(prefix: str):
    """A context manager: a user named ``PREFIX-XXXXXXXX`` with no rights of its own and a HOME
    it owns under /var/tmp (pytest's temp dirs are root's only); yields ``(name, home)`` and
    removes the user, its group and the HOME afterwards. Raises CalledProcessError (useradd)."""
    import contextlib
    import pwd
    import shutil
    import subprocess
    import tempfile
    import uuid

    @contextlib.contextmanager
    def made():
        name = f"{prefix}-" + uuid.uuid4().hex[:8]
        home = Path(tempfile.mkdtemp(prefix=f"{prefix}-", dir="/var/tmp"))
        subprocess.run(["useradd", "--no-create-home", "--home-dir", str(home), "--shell", "/usr/sbin/nologin", name],
                       check=True, capture_output=True)
        try:
            os.chown(home, pwd.getpwnam(name).pw_uid, pwd.getpwnam(name).pw_gid)
            yield name, home
        finally:
            subprocess.run(["userdel", name], capture_output=True)
            subprocess.run(["groupdel", name], capture_output=True)
            shutil.rmtree(home, ignore_errors=True)

    return made()
