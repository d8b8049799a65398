"""A real registry for the fleet tests and benchmarks: CNCF distribution (Debian's
``docker-registry``, installed by scripts/setup.sh) on 127.0.0.1, filesystem storage in a temp
dir, its access log captured (one line per request) so tests can count blob requests."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import requests

from . import free_port

BINARY = shutil.which("docker-registry") or "/usr/bin/docker-registry"


class RegistryServer:
    """``docker-registry serve`` on a free loopback port: ``host`` is ``127.0.0.1:PORT``,
    ``storage`` its root dir, ``log`` the file its stdout/stderr go to. ``access_log=False``
    (throughput benchmarks): no line per request is written, so :meth:`requests_log` is empty."""

    def __init__(self, base: Path, access_log: bool = True):
        self.base = base
        self.storage = base / "storage"
        self.storage.mkdir(parents=True)
        self.port = free_port()
        self.host = f"127.0.0.1:{self.port}"
        self.log = base / "registry.log"
        cfg = base / "config.yml"
        cfg.write_text(
            "version: 0.1\n"
            f"log:\n  level: info\n  accesslog:\n    disabled: {'false' if access_log else 'true'}\n"
            f"storage:\n  filesystem:\n    rootdirectory: {self.storage}\n  delete:\n    enabled: true\n"
            f"http:\n  addr: 127.0.0.1:{self.port}\n")
        self._out = open(self.log, "ab")
        self.proc = subprocess.Popen([BINARY, "serve", str(cfg)], stdout=self._out, stderr=subprocess.STDOUT,
                                     env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")})
        deadline = time.monotonic() + 20
        while True:
            try:
                if requests.get(f"http://{self.host}/v2/", timeout=1).status_code == 200:
                    break
            except requests.RequestException:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"docker-registry did not start: {self.log.read_text()[-2000:]}")
            time.sleep(0.1)

    def requests_log(self) -> list[str]:
        """Every access-log line so far (``"METHOD /v2/... HTTP/1.1" STATUS``)."""
        return [line for line in self.log.read_text(errors="replace").splitlines() if '"' in line and "/v2/" in line
                and re.search(r'"(GET|HEAD|PUT|POST|PATCH|DELETE) /v2/', line)]

    def blob_gets(self, since: int = 0) -> list[str]:
        """Access-log lines (from index ``since``) that fetched a blob (GET .../blobs/sha256:...)."""
        return [line for line in self.requests_log()[since:] if re.search(r'"GET /v2/\S+/blobs/sha256:', line)]

    def blob_path(self, digest: str) -> Path:
        """Where the registry stores blob ``digest`` (to damage it at rest)."""
        hx = digest.split(":", 1)[1]
        return self.storage / "docker" / "registry" / "v2" / "blobs" / "sha256" / hx[:2] / hx / "data"

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._out.close()
