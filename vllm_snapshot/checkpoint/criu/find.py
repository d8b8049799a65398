"""Finding CRIU: the binary (:func:`find_criu`), its version (:func:`criu_version`,
:func:`version_ok`), the CUDA plugin of the same build (:func:`find_cuda_plugin`, :func:`paired`),
CRIU's configuration files that could redirect its plugins (:func:`check_config_libdir`), and
the environment a CUDA run needs (:func:`cuda_env`)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

from ... import paths
from ...errors import EnvironmentProblem, q

#: The oldest CRIU used (4.1.1 fails on kernels >= 6.16: docs/operations.md, "Distro CRIU").
MIN_VERSION = (4, 2)


def find_criu() -> str:
    """Path of the criu binary: ``$VLLM_SNAPSHOT_CRIU``, the setup cache, then ``$PATH``.

    Raises EnvironmentProblem when none is found.
    """
    cands = [os.environ.get("VLLM_SNAPSHOT_CRIU")]
    cands.append(str(paths.cache_dir() / "bin" / "criu"))
    cands.append(shutil.which("criu"))
    for c in cands:
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return os.path.realpath(c)
    raise EnvironmentProblem(
        "CRIU not found", hint="run scripts/setup.sh, or install CRIU >= 4.2 (criu check must pass)"
    )


def criu_version(binary: str) -> str:
    """``criu --version``'s ``Version:`` value, e.g. ``"4.2.1"``. Raises EnvironmentProblem."""
    try:
        out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10).stdout
    except OSError as e:
        raise EnvironmentProblem(f"cannot run {binary}: {e}") from e
    v = parse_version(out)
    if v is None:
        raise EnvironmentProblem(f"cannot parse `{q(binary)} --version` output: {out!r}")
    return v


def parse_version(text: str) -> str | None:
    """The ``Version:`` value of ``criu --version`` output (``"4.2.1"``), or None. Pure."""
    m = re.search(r"Version:\s*(\S+)", text)
    return m.group(1) if m else None


def version_ok(version: str) -> bool:
    """True for CRIU >= :data:`MIN_VERSION` (4.1.1 fails on kernels >= 6.16: docs/operations.md, "Distro CRIU")."""
    parts = [int(p) for p in re.findall(r"\d+", version)[:2]]
    return tuple(parts) >= MIN_VERSION


#: Where distributions install CRIU plugins (Debian/Ubuntu ``criu`` >= 4.0 ships
#: ``cuda_plugin.so`` in the first; CRIU's ``make install`` uses the second).
SYSTEM_PLUGIN_DIRS = ("/usr/lib/criu", "/usr/local/lib/criu", "/usr/lib/x86_64-linux-gnu/criu")
CUDA_PLUGIN = "cuda_plugin.so"
#: Binary directory -> the plugin directories of the same installation (one package/prefix).
_SYSTEM_PAIRS = {"/usr/sbin": ("/usr/lib/criu", "/usr/lib/x86_64-linux-gnu/criu"),
                 "/usr/bin": ("/usr/lib/criu", "/usr/lib/x86_64-linux-gnu/criu"),
                 "/sbin": ("/usr/lib/criu", "/usr/lib/x86_64-linux-gnu/criu"),
                 "/bin": ("/usr/lib/criu", "/usr/lib/x86_64-linux-gnu/criu"),
                 "/usr/local/sbin": ("/usr/local/lib/criu",), "/usr/local/bin": ("/usr/local/lib/criu",)}


def plugin_candidates(criu_binary: str | None, cache: Path | None = None) -> list[Path]:
    """Where CRIU's CUDA plugin may be, in the order used: beside a source-built binary
    (``<src>/plugins/cuda``; pass the resolved binary path), the setup cache's build (``cache``,
    default :func:`paths.cache_dir`), then the system plugin directories. Pure. Doctor and
    CRIU runs both use this list (through :func:`find_cuda_plugin`)."""
    out = []
    if criu_binary:
        src = Path(criu_binary).parent.parent  # <src>/criu/criu -> <src>
        out.append(src / "plugins" / "cuda" / CUDA_PLUGIN)
    out.append((cache or paths.cache_dir()) / "criu-4.2.1" / "plugins" / "cuda" / CUDA_PLUGIN)
    out += [Path(d) / CUDA_PLUGIN for d in SYSTEM_PLUGIN_DIRS]
    return list(dict.fromkeys(out))


def _same_file(a: str, b: str) -> bool:
    import filecmp

    if a == b:
        return True
    try:
        return os.path.samefile(a, b) or filecmp.cmp(a, b, shallow=False)
    except OSError:
        return False


def paired(plugin: Path, criu_binary: str, same_file=_same_file) -> bool:
    """True when ``plugin`` comes from the same build as ``criu_binary`` (resolved path). Pure
    but for ``same_file`` (a content comparison of two binaries).

    The plugin is not a stable ABI: it reads CRIU's internal ``opts`` struct
    (``opts.timeout``, ``opts.final_state``: CRIU 4.2.1 plugins/cuda/cuda_plugin.c:451, :621)
    and calls CRIU's own functions, and CRIU only checks a coarse plugin version
    (``CRIU_PLUGIN_VERSION`` 0.2.0, criu/include/criu-plugin.h:29-36). Paired are: the plugin of
    a source tree whose ``criu/criu`` is this binary (same file or same bytes), and a
    distribution's plugin directory for a binary of the same prefix (``/usr/sbin/criu`` with
    ``/usr/lib/criu``, ``/usr/local/sbin/criu`` with ``/usr/local/lib/criu``)."""
    src_bin = plugin.parent.parent.parent / "criu" / "criu"  # <src>/plugins/cuda/x.so -> <src>/criu/criu
    if plugin.parent.name == "cuda" and plugin.parent.parent.name == "plugins":
        return same_file(str(src_bin), criu_binary)
    return str(plugin.parent) in _SYSTEM_PAIRS.get(os.path.dirname(criu_binary), ())


def find_cuda_plugin(criu_binary: str | None, is_file=os.path.isfile, cache: Path | None = None,
                     same_file=_same_file) -> Path:
    """The first :func:`plugin_candidates` entry that exists and is :func:`paired` with
    ``criu_binary``. Raises EnvironmentProblem listing where it looked, or naming a plugin
    that exists but belongs to another CRIU build (refused: loading it into this binary
    reads that binary's internals with another layout)."""
    binary = os.path.realpath(criu_binary) if criu_binary else None
    cands = plugin_candidates(binary, cache)
    found = [c for c in cands if is_file(str(c))]
    for c in found:
        if binary and paired(c, binary, same_file):
            return c
    if found:
        raise EnvironmentProblem(
            f"CRIU's CUDA plugin {found[0]} was built for another CRIU than the one that would load it "
            f"({binary}); the plugin reads CRIU's internal option struct, so both must come from one build",
            hint="use the criu binary of the same build (set VLLM_SNAPSHOT_CRIU), or build the plugin with "
                 "this CRIU (`make cuda_plugin` in its source tree; scripts/setup.sh does it for its own build)")
    raise EnvironmentProblem(
        "CRIU's CUDA plugin (cuda_plugin.so) is missing; looked in: " + ", ".join(map(str, cands)),
        hint="run scripts/setup.sh (it builds the plugin with CRIU), or install your distribution's criu package")


#: CRIU's configuration files, read in this order also by ``criu swrk`` (CRIU 4.2.1
#: criu/config.c:320-370 ``next_config``: GLOBAL_CONFIG_DIR ``/etc/criu/``, ``$HOME/.criu/``,
#: then ``$CRIU_CONFIG_FILE``).
CONFIG_FILES = ("/etc/criu/default.conf", "~/.criu/default.conf")


def config_libdirs(read_text, env: dict[str, str]) -> list[tuple[str, str]]:
    """``(file, directory)`` of every ``libdir``/``L`` setting in CRIU's configuration files
    (:data:`CONFIG_FILES`, ``env["CRIU_CONFIG_FILE"]``). ``read_text(path)`` returns the
    file's text or None. Pure over it.

    Such a setting beats ``CRIU_LIBS_DIR``: CRIU 4.2.1 criu/plugin.c:214-222 reads the
    environment only when ``opts.libdir`` is unset, and config files set it before any RPC
    request is read."""
    home = env.get("HOME", "/root")
    files = [f.replace("~", home, 1) for f in CONFIG_FILES]
    if env.get("CRIU_CONFIG_FILE"):
        files.append(env["CRIU_CONFIG_FILE"])
    out = []
    for f in files:
        text = read_text(f)
        for line in (text or "").splitlines():
            words = line.split("#", 1)[0].split()
            if not words:
                continue
            key = words[0].lstrip("-")
            if key in ("libdir", "L") and len(words) > 1:
                out.append((f, words[1]))
            elif key.startswith("libdir="):
                out.append((f, key.split("=", 1)[1]))
    return out


def _read_text(path: str) -> str | None:
    try:
        return Path(path).read_text(errors="replace")
    except OSError:
        return None


def check_config_libdir(plugin_dir: Path, read_text=_read_text, env: dict[str, str] | None = None) -> None:
    """Raise EnvironmentProblem when a CRIU configuration file sets a plugin directory other
    than ``plugin_dir`` (CRIU would silently load its plugins instead of ours, or none)."""
    for f, d in config_libdirs(read_text, dict(os.environ) if env is None else env):
        if os.path.realpath(d) != os.path.realpath(plugin_dir):
            raise EnvironmentProblem(
                f"{f} sets CRIU's plugin directory to {d}; CRIU would load plugins from there instead of "
                f"{plugin_dir} (a libdir in a config file beats CRIU_LIBS_DIR)",
                hint=f"remove the libdir line from {f}, or point it to {plugin_dir}")


def cuda_env(criu_binary: str) -> dict[str, str]:
    """Environment for a CRIU run on a CUDA engine: ``CRIU_LIBS_DIR`` = the directory of the
    CUDA plugin paired with ``criu_binary`` (CRIU 4.2.1 criu/plugin.c reads it when no ``-L``
    is given), and ``PATH`` with our ``cuda-checkpoint`` helper first (the plugin execs it from
    PATH), unless ``VLLM_SNAPSHOT_CUDA_CHECKPOINT`` names NVIDIA's binary. Raises
    EnvironmentProblem when the plugin is missing or of another build, when a CRIU config file
    redirects the plugin directory, or when ``VLLM_SNAPSHOT_CUDA_CHECKPOINT`` is not an
    executable named ``cuda-checkpoint`` (the plugin runs that name only)."""
    from .. import cuda_checkpoint

    plugin = find_cuda_plugin(criu_binary)
    check_config_libdir(plugin.parent)
    own = os.environ.get("VLLM_SNAPSHOT_CUDA_CHECKPOINT")
    if own and (os.path.basename(own) != cuda_checkpoint.PROG or not os.access(own, os.X_OK)):
        raise EnvironmentProblem(
            f"VLLM_SNAPSHOT_CUDA_CHECKPOINT={own} must be an executable file named cuda-checkpoint "
            "(CRIU's plugin runs that name from PATH)", hint="point it to NVIDIA's cuda-checkpoint binary, or unset it")
    helper = Path(own).parent if own else cuda_checkpoint.helper_dir(paths.cache_dir())
    return {"CRIU_LIBS_DIR": str(plugin.parent), "PATH": f"{helper}:{os.environ.get('PATH', '/usr/bin:/bin')}"}
