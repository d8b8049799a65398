"""Reading CRIU's images: what the dumped tree's root held (:func:`caps_missing`)."""

from __future__ import annotations

from pathlib import Path


def caps_missing(images_dir: Path, m, own_status: str) -> list[int]:
    """Capabilities the dumped engine root of the snapshot ``m`` held that a process with
    ``/proc/self/status`` text ``own_status`` cannot give back
    (:func:`vllm_snapshot.host.privilege.caps_beyond` over the root's core image in
    ``images_dir``); [] when the image is absent or cannot be read (CRIU then decides)."""
    from ...host import privilege

    root = 1 if m.criu.pid_namespace else m.criu.root_pid  # the images name namespace PIDs
    img = next((i for i in m.images if i.name.split(".")[0] == f"core-{root}"), None)
    if img is None:
        return []
    try:
        import io

        import pycriu

        from ...store.archive import open_raw

        with open_raw(images_dir, img) as r:
            raw = b"".join(iter(lambda: r.read(1 << 20), b""))
        creds = pycriu.images.load(io.BytesIO(raw))["entries"][0]["thread_core"]["creds"]
        return privilege.caps_beyond(creds, own_status)
    except Exception:  # noqa: BLE001 - an unreadable image is CRIU's to report
        return []
