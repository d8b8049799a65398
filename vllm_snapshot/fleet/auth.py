"""Who the registry client is and whom it trusts: credentials from the docker/podman auth files
and credential helpers (:func:`credentials`, through the ``docker`` package's ``docker.auth``;
the files in :func:`auth_files`' order), and the certificate authorities of a registry
(:func:`ca_bundle`: ``certs.d`` as podman, skopeo and docker read it, else
``$REQUESTS_CA_BUNDLE`` / ``$SSL_CERT_FILE``).
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

from ..errors import EnvironmentProblem

AUTH_HINT = ("log in with `podman login HOST` or `docker login HOST` (or set REGISTRY_AUTH_FILE to an auth file); "
             "--plain-http only for a registry on loopback")


def auth_files() -> list[Path]:
    """The auth files looked at, in order (podman's, then docker's)."""
    out = []
    if os.environ.get("REGISTRY_AUTH_FILE"):
        out.append(Path(os.environ["REGISTRY_AUTH_FILE"]))
    if os.environ.get("XDG_RUNTIME_DIR"):
        out.append(Path(os.environ["XDG_RUNTIME_DIR"]) / "containers" / "auth.json")
    home = Path(os.path.expanduser("~"))
    out.append(home / ".config" / "containers" / "auth.json")
    out.append(Path(os.environ.get("DOCKER_CONFIG", home / ".docker")) / "config.json")
    return out


#: Where podman/skopeo (containers-certs.d(5)) and docker look for a registry's own certificate
#: authorities: ``DIR/HOST[:PORT]/*.crt``.
CERTS_DIRS = (Path("/etc/containers/certs.d"), Path("/etc/docker/certs.d"))
_BUNDLES: dict[str, str] = {}
_BUNDLES_LOCK = threading.Lock()


def ca_bundle(host: str, certs_dirs: tuple[Path, ...] = CERTS_DIRS, environ=None) -> str | bool:
    """What to trust for ``host`` (``name[:port]``) over HTTPS, as ``requests``' ``verify``: the
    ``*.crt`` files of ``certs_dirs/HOST`` (podman's, skopeo's and docker's per-registry
    authorities; several are joined into one private bundle file, 0600, removed at exit), else
    ``$REQUESTS_CA_BUNDLE`` / ``$SSL_CERT_FILE`` (read on purpose: the sessions ignore the
    environment so that no proxy variable redirects registry traffic), else True (the public
    authorities certifi ships). Raises EnvironmentProblem naming a named file that does not exist."""
    env = os.environ if environ is None else environ
    for d in certs_dirs:
        reg = d / host
        try:
            crts = sorted(p for p in reg.iterdir() if p.suffix == ".crt" and p.is_file())
        except OSError:
            continue
        if len(crts) == 1:
            return str(crts[0])
        if crts:
            key = "\0".join(map(str, crts))
            with _BUNDLES_LOCK:
                if key not in _BUNDLES:
                    import atexit
                    import tempfile

                    fd, path = tempfile.mkstemp(prefix="vllm-snapshot-ca-", suffix=".pem")
                    with os.fdopen(fd, "wb") as f:  # mkstemp: 0600
                        for c in crts:
                            f.write(c.read_bytes().rstrip(b"\n") + b"\n")
                    atexit.register(lambda q=path: os.path.exists(q) and os.unlink(q))
                    _BUNDLES[key] = path
                return _BUNDLES[key]
    for var in ("REQUESTS_CA_BUNDLE", "SSL_CERT_FILE"):
        named = env.get(var)
        if named:
            if not os.path.exists(named):
                raise EnvironmentProblem(f"${var} names {named}, which does not exist",
                                         hint=f"point {var} at the PEM file of your registry's certificate authority, "
                                              "or unset it")
            return named
    return True


def credentials(host: str) -> tuple[str, str] | None:
    """``(username, password)`` for ``host`` from the first auth file that has an entry for
    it (credential helpers and stores included, through ``docker.auth``), or None."""
    from docker import auth as dauth

    for f in auth_files():
        if not f.is_file():
            continue
        try:
            cfg = dauth.load_config(config_path=str(f))
            found = dauth.resolve_authconfig(cfg, registry=host)
        except Exception as e:  # noqa: BLE001 - a helper that fails: say which file
            raise EnvironmentProblem(f"cannot read the credentials for {host} from {f}: {e}", hint=AUTH_HINT) from e
        if found:
            user = found.get("username") or found.get("Username") or ""
            pw = found.get("password") or found.get("Password") or found.get("IdentityToken") or ""
            if user or pw:
                return user, pw
    return None
