"""Rendering: rich tables for humans, stable JSON for scripts. Nothing else prints results."""

from __future__ import annotations

import json
import sys

from rich.console import Console
from rich.table import Table

from .manifest import Manifest

JSON_SCHEMA_VERSION = 1


def _console() -> Console:
    """A terminal-width console; 140 columns when stdout is not a terminal (piped into a log or
    `less`), where rich's 80-column default wraps every table cell."""
    return Console() if sys.stdout.isatty() else Console(width=140)


def human_bytes(n: float) -> str:
    """``1536`` -> ``"1.5 KiB"``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def emit_json(obj: dict) -> None:
    """Print ``obj`` with ``schema_version`` added, as sorted, indented JSON on stdout."""
    sys.stdout.write(json.dumps({"schema_version": JSON_SCHEMA_VERSION, **obj}, indent=2, sort_keys=True) + "\n")


def manifest_table(m: Manifest, path: str) -> None:
    """Print the manifest of the snapshot at ``path`` as tables."""
    c = _console()
    t = Table(title=f"snapshot {path}", show_header=False, title_justify="left")
    t.add_column(style="bold")
    t.add_column()
    t.add_row("created", f"{m.created_at} by vllm-snapshot {m.tool_version}")
    t.add_row("engine", f"{m.engine.kind}, sleep level {m.engine.sleep_level}"
              + (" (full state captured)" if m.engine.full_state_captured else ""))
    t.add_row("model", f"{m.model.requested}  [dim]({m.model.path}, {len(m.model.files)} files, {human_bytes(m.model.total_bytes)})[/]")
    t.add_row("served as", m.model.served_name)
    t.add_row("engine args", " ".join(m.engine.engine_args) or "[dim](none)[/]")
    o = m.oracle
    t.add_row("oracle", f"{o.prompt!r} → token {o.token_id} {o.text!r}, logprob {o.logprob:.6f}")
    t.add_row("images", f"{len(m.images)} files, raw {human_bytes(m.sizes['raw'])}, stored {human_bytes(m.sizes['stored'])}"
              + (f" ({100 * m.sizes['stored'] / max(1, m.sizes['raw']):.1f}%)" if m.sizes['raw'] else ""))
    t.add_row("compression", ", ".join(sorted({i.compression for i in m.images})) or "none")
    t.add_row("CRIU", f"{m.criu.version}  flags: {' '.join('--' + f for f in m.criu.flags)}")
    t.add_row("process tree", f"{len(m.criu.tree_pids)} processes (own PID namespace: {m.criu.pid_namespace})")
    c.print(t)
    h = Table(title="host identity", title_justify="left")
    h.add_column("field", style="bold")
    h.add_column("value")
    for k in sorted(m.host):
        h.add_row(k, m.host[k])
    c.print(h)
    p = Table(title="phase timings", title_justify="left")
    p.add_column("phase", style="bold")
    p.add_column("seconds", justify="right")
    for k, v in m.timings.items():
        p.add_row(k, f"{v:.2f}")
    p.add_row("total", f"{sum(m.timings.values()):.2f}", style="bold")
    c.print(p)


def timings_table(title: str, timings: dict[str, float]) -> None:
    """Print ``{phase: seconds}`` as a table with a total."""
    c = _console()
    p = Table(title=title, title_justify="left")
    p.add_column("phase", style="bold")
    p.add_column("seconds", justify="right")
    for k, v in timings.items():
        p.add_row(k, f"{v:.2f}")
    p.add_row("total", f"{sum(timings.values()):.2f}", style="bold")
    c.print(p)


def _when(ts: float | None) -> str:
    import datetime as dt

    return dt.datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M:%S") if ts else "-"


def snapshot_list(rows: list[dict], root: str) -> None:
    """Print ``list`` rows as a table."""
    c = _console()
    if not rows:
        c.print(f"no snapshots under {root}")
        return
    t = Table(title=f"snapshots under {root}", title_justify="left")
    for col in ("name", "model", "created", "kind", "sleep", "raw", "stored", "here", "last restore"):
        t.add_column(col)
    for r in rows:
        why = r["why"] if len(r["why"]) <= 70 else r["why"][:69] + "…"
        here = "[green]✓[/]" if r["compatible"] else f"[red]✗[/] {why}"
        model = (r["model"] or "-").rstrip("/").rsplit("/", 1)[-1]
        created = (r["created"] or "-")[:16].replace("T", " ")
        t.add_row(r["name"], model, created, str(r["kind"] or "-"),
                  str(r["sleep_level"] if r["sleep_level"] is not None else "-"),
                  human_bytes(r["raw_bytes"]) if r["raw_bytes"] is not None else "-",
                  human_bytes(r["stored_bytes"]) if r["stored_bytes"] is not None else "-",
                  here, _when(r["last_restore"]))
    c.print(t)


def engine_list(rows: list[dict]) -> None:
    """Print ``status`` rows as a table."""
    c = _console()
    if not rows:
        c.print("no restored engines running")
        return
    t = Table(title="restored engines", title_justify="left")
    for col in ("snapshot", "pid", "url", "started", "mode"):
        t.add_column(col)
    for r in rows:
        t.add_row(r["snapshot"], str(r["pid"]), r["url"], _when(r["started_at"]), r["mode"])
    c.print(t)
