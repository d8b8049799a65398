"""A fault-injecting HTTP/1.1 proxy for registry traffic: what a real network and the things
in front of a registry do to a transfer, on demand and counted.

Put it in front of a registry (Debian's docker-registry on loopback, :mod:`registry_server`)
and point the client at :attr:`FaultProxy.host`; requests go through unchanged (the ``Host``
header too, so the registry's upload ``Location`` URLs name the proxy) until a :class:`Fault`
matches one. Faults (``action``):

* ``reset``: after ``after`` bytes of the body -- the response's for a request without one
  (GET), the request's for an upload (PUT/PATCH/POST) -- the connection is reset (RST).
* ``close``: the same, but closed cleanly (FIN): a body shorter than its Content-Length.
* ``short``: the response is sent chunked (no Content-Length) and ends cleanly after
  ``after`` bytes: a short body no protocol error reveals.
* ``stall``: after ``after`` bytes nothing more is sent (or read) for ``seconds``, then the
  connection is closed.
* ``status``: answered with ``status`` (e.g. 500, 503 with ``retry_after``, 413, 416) without
  asking the registry.
* ``range416``: a request with a ``Range`` header is answered 416.
* ``bad206``: a request with ``Range: bytes=N-`` is sent on as ``bytes=N+shift-``: the client
  gets a 206 at another offset.
* ``ignore-range``: the ``Range`` header is dropped: the registry answers 200 with the whole blob.
* ``expire-token``: (``token_auth``) every token issued so far stops being valid, and this
  request is answered 401 with a Bearer challenge: a token that expired mid-transfer.
* ``truncate-body``: an upload's body is read whole but only its first ``after`` bytes go on
  to the registry (Content-Length and a ``Content-Range: A-B`` shortened to match): the
  registry takes fewer bytes of a PATCH than were sent, and says so in its ``Range``.

A fault matches a request by ``method`` (None: any), ``path`` (a regex searched in the path),
``ranged`` (None: either; True/False: only requests with/without a Range header); it lets the
first ``skip`` matching requests through, then acts on ``times`` of them (None: every one).

Settings that hold for every request: ``body_limit`` (bytes: a request body larger than this
is answered 413 after it was read, as nginx's ``client_max_body_size`` does), ``rate`` (bytes
per second: response and request bodies are paced to it, a slow link), ``chunk_min_length``
(added as ``OCI-Chunk-Min-Length`` to the answer that starts an upload), ``token_auth`` (the
proxy demands ``Authorization: Bearer TOKEN`` on ``/v2/`` requests and issues tokens at
``/token``, counted in :attr:`FaultProxy.token_requests`; the header is not sent on).

Use::

    with FaultProxy(registry.host) as proxy:
        proxy.add(Fault("reset", method="GET", path=r"/blobs/sha256:", after=100_000))
        ... client at proxy.host ...
        proxy.log  # one dict per request: method, path, status, sent, received, fault

or as a process of its own (e.g. inside another network namespace)::

    python tests/faultproxy.py --upstream 127.0.0.1:5000 --listen 0.0.0.0:5001 \\
        [--token-auth] [--body-limit N] [--rate BYTES_PER_S] [--fault '{"action": "reset", "after": 1000}']

whose faults are changed while it runs through its control API (JSON): ``POST
/_faultproxy/faults`` (a fault, or a list), ``DELETE /_faultproxy/faults``, ``POST
/_faultproxy/settings`` (``body_limit``, ``rate``), ``POST /_faultproxy/expire``, ``GET
/_faultproxy/log``, ``GET /_faultproxy/state`` (faults with their counts, token requests).
"""

from __future__ import annotations

import argparse
import http.client
import http.server
import json
import re
import secrets
import socket
import socketserver
import struct
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from urllib.parse import parse_qs, urlparse

HOP = {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "trailer", "upgrade"}
ACTIONS = {"reset", "close", "short", "stall", "status", "range416", "bad206", "ignore-range", "expire-token",
           "truncate-body"}
PIECE = 64 << 10


@dataclass
class Fault:
    """One fault (see the module doc). ``fired`` counts the requests it acted on."""

    action: str
    method: str | None = None
    path: str = ""
    after: int = 0
    times: int | None = 1
    skip: int = 0
    seconds: float = 30.0
    status: int = 503
    retry_after: int | None = None
    ranged: bool | None = None
    shift: int = 4096
    fired: int = 0
    seen: int = field(default=0, repr=False)

    def __post_init__(self):
        if self.action not in ACTIONS:
            raise ValueError(f"unknown fault action {self.action!r} (one of {sorted(ACTIONS)})")

    def matches(self, method: str, path: str, ranged: bool) -> bool:
        if self.method is not None and self.method.upper() != method:
            return False
        if self.path and not re.search(self.path, path):
            return False
        if self.ranged is not None and self.ranged != ranged:
            return False
        if self.action in ("range416", "bad206") and not ranged:
            return False
        return self.times is None or self.fired < self.times

    def to_json(self) -> dict:
        d = asdict(self)
        d.pop("seen")
        return d


class _Cut(Exception):
    """The connection was reset or closed on purpose: nothing more to do with it."""


class FaultProxy:
    """The proxy (see the module doc): listening on ``listen`` (``HOST:PORT``, port 0: a free
    one), forwarding to ``upstream`` (``HOST:PORT``). ``host`` is where it listens."""

    def __init__(self, upstream: str, listen: str = "127.0.0.1:0", token_auth: bool = False,
                 body_limit: int | None = None, rate: float | None = None, chunk_min_length: int | None = None):
        self.upstream = upstream
        self.token_auth = token_auth
        self.body_limit = body_limit
        self.rate = rate
        self.chunk_min_length = chunk_min_length
        self.faults: list[Fault] = []
        self.log: list[dict] = []
        self.token_requests = 0
        self.tokens: set[str] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        lhost, _, lport = listen.rpartition(":")
        proxy = self

        class Handler(_Handler):
            pass

        Handler.proxy = proxy

        class Server(socketserver.ThreadingMixIn, http.server.HTTPServer):
            daemon_threads = True
            allow_reuse_address = True
            request_queue_size = 64

            def handle_error(self, request, client_address):  # a client that went away: not news
                pass

        self.server = Server((lhost or "127.0.0.1", int(lport or 0)), Handler)
        self.host = f"{lhost or '127.0.0.1'}:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, name="faultproxy", daemon=True)
        self._thread.start()

    # -- faults --------------------------------------------------------------------------

    def add(self, *faults: Fault) -> "FaultProxy":
        """Add faults (checked in the order added; the first that matches acts)."""
        with self._lock:
            self.faults.extend(faults)
        return self

    def clear(self) -> None:
        """Drop every fault (settings stay)."""
        with self._lock:
            self.faults.clear()

    def expire_tokens(self) -> None:
        """Every token issued so far stops being valid (``token_auth``)."""
        with self._lock:
            self.tokens.clear()

    def pick(self, method: str, path: str, ranged: bool) -> Fault | None:
        with self._lock:
            for f in self.faults:
                if f.matches(method, path, ranged):
                    f.seen += 1
                    if f.seen <= f.skip:
                        return None
                    f.fired += 1
                    return f
        return None

    def requests(self, method: str | None = None, path: str = "") -> list[dict]:
        """The logged requests of ``method`` whose path matches regex ``path``."""
        with self._lock:
            return [e for e in self.log if (method is None or e["method"] == method)
                    and (not path or re.search(path, e["path"]))]

    def state(self) -> dict:
        with self._lock:
            return {"faults": [f.to_json() for f in self.faults], "token_requests": self.token_requests,
                    "body_limit": self.body_limit, "rate": self.rate, "chunk_min_length": self.chunk_min_length,
                    "requests": len(self.log)}

    # -- life ----------------------------------------------------------------------------

    def stop(self) -> None:
        self._stop.set()
        self.server.shutdown()
        self.server.server_close()

    def __enter__(self) -> "FaultProxy":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    proxy: FaultProxy
    timeout = 300

    def log_message(self, *a):
        pass

    def handle(self):
        self.close_connection = True
        try:
            self.handle_one_request()
            while not self.close_connection:
                self.handle_one_request()
        except (_Cut, OSError, http.client.HTTPException):
            pass

    def finish(self):
        try:
            super().finish()
        except (OSError, ValueError):
            pass

    def do_GET(self):
        self._serve()

    do_HEAD = do_PUT = do_POST = do_PATCH = do_DELETE = do_GET

    # -- pieces --------------------------------------------------------------------------

    def _pace(self, n: int, t0: float, done: int) -> None:
        rate = self.proxy.rate
        if rate:
            ahead = (done + n) / rate - (time.monotonic() - t0)
            if ahead > 0:
                self.proxy._stop.wait(ahead)

    def _cut(self, how: str) -> None:
        """Reset (RST) or close (FIN) the client's connection, then stop handling it."""
        self.close_connection = True
        try:
            self.wfile.flush()
        except (OSError, ValueError):
            pass
        if how == "reset":
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        else:
            try:
                self.connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self.connection.close()
        raise _Cut(how)

    def _stall(self, f: Fault) -> None:
        self.proxy._stop.wait(f.seconds)
        self._cut("close")

    def _body_reader(self):
        """The request body, as pieces (Content-Length or chunked)."""
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            while True:
                line = self.rfile.readline(1024)
                n = int(line.split(b";")[0].strip() or b"0", 16)
                if n == 0:
                    while self.rfile.readline(1024) not in (b"\r\n", b"\n", b""):
                        pass
                    return
                left = n
                while left:
                    piece = self.rfile.read(min(PIECE, left))
                    if not piece:
                        raise _Cut("client went away")
                    left -= len(piece)
                    yield piece
                self.rfile.readline(8)
        left = int(self.headers.get("Content-Length") or 0)
        while left > 0:
            piece = self.rfile.read(min(PIECE, left))
            if not piece:
                raise _Cut("client went away")
            left -= len(piece)
            yield piece

    def _drain(self) -> int:
        n = 0
        for piece in self._body_reader():
            n += len(piece)
        return n

    def _answer(self, status: int, body: bytes = b"", headers: dict | None = None) -> None:
        self.send_response(status)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if body and self.command != "HEAD":
            self.wfile.write(body)

    def _record(self, **kw) -> dict:
        """Log this request (before its answer goes out: a client that got it finds it logged);
        the entry is updated as the body goes (``sent``)."""
        entry = {"method": self.command, "path": self.path, **kw}
        with self.proxy._lock:
            self.proxy.log.append(entry)
        return entry

    # -- control API, token service ------------------------------------------------------

    def _control(self) -> None:
        p = self.proxy
        body = b"".join(self._body_reader())
        doc = json.loads(body) if body.strip() else None
        out: object = {"ok": True}
        what = self.path.split("?", 1)[0].removeprefix("/_faultproxy/")
        if what == "faults" and self.command == "POST":
            p.add(*[Fault(**d) for d in (doc if isinstance(doc, list) else [doc])])
        elif what == "faults" and self.command == "DELETE":
            p.clear()
        elif what == "settings" and self.command == "POST":
            for k in ("body_limit", "rate", "chunk_min_length"):
                if k in doc:
                    setattr(p, k, doc[k])
        elif what == "expire":
            p.expire_tokens()
        elif what == "log":
            with p._lock:
                out = list(p.log)
        elif what == "state":
            out = p.state()
        else:
            return self._answer(404, b'{"error": "unknown control path"}')
        self._answer(200, json.dumps(out).encode(), {"Content-Type": "application/json"})

    def _token(self) -> None:
        p = self.proxy
        self._drain()
        tok = secrets.token_hex(16)
        with p._lock:
            p.token_requests += 1
            p.tokens.add(tok)
        self._record(status=200, sent=0, received=0, fault="token")
        self._answer(200, json.dumps({"token": tok, "expires_in": 300}).encode(), {"Content-Type": "application/json"})

    def _challenge(self, fault: str | None) -> None:
        n = self._drain()
        repo = re.match(r"/v2/(.+?)/(?:blobs|manifests|tags)/", self.path)
        scope = f'repository:{repo.group(1)}:pull,push' if repo else ""
        host = self.headers.get("Host") or self.proxy.host
        chal = f'Bearer realm="http://{host}/token",service="faultproxy"' + (f',scope="{scope}"' if scope else "")
        self._record(status=401, sent=0, received=n, fault=fault or "no-token")
        self._answer(401, b'{"errors":[{"code":"UNAUTHORIZED","message":"authentication required"}]}',
                     {"WWW-Authenticate": chal, "Content-Type": "application/json"})

    # -- the proxying --------------------------------------------------------------------

    def _serve(self) -> None:
        p = self.proxy
        path = self.path
        if path.startswith("/_faultproxy/"):
            return self._control()
        if p.token_auth and path.startswith("/token"):
            return self._token()
        ranged = "Range" in self.headers
        if p.token_auth and path.startswith("/v2/"):  # before any fault: a challenged request uses none up
            auth = self.headers.get("Authorization", "")
            with p._lock:
                ok = auth.startswith("Bearer ") and auth[7:] in p.tokens
            if not ok:
                return self._challenge(None)
        f = p.pick(self.command, path, ranged)
        if f is not None and f.action == "expire-token":
            p.expire_tokens()
            return self._challenge("expire-token")
        if f is not None and f.action == "status":
            n = self._drain()
            self._record(status=f.status, sent=0, received=n, fault="status")
            hdrs = {"Retry-After": str(f.retry_after)} if f.retry_after is not None else {}
            return self._answer(f.status, json.dumps({"errors": [{"code": "FAULTPROXY", "message":
                                                                  f"injected {f.status}"}]}).encode(), hdrs)
        if f is not None and f.action == "range416":
            n = self._drain()
            self._record(status=416, sent=0, received=n, fault="range416")
            return self._answer(416, b"range not satisfiable (faultproxy)")
        length = self.headers.get("Content-Length")
        if p.body_limit is not None and length is not None and int(length) > p.body_limit:
            n = self._drain()
            self._record(status=413, sent=0, received=n, fault="body-limit")
            return self._answer(413, b"<html><body>413 Request Entity Too Large (faultproxy)</body></html>",
                                {"Content-Type": "text/html"})
        headers = [(k, v) for k, v in self.headers.items()
                   if k.lower() not in HOP and not (p.token_auth and k.lower() == "authorization")]
        if f is not None and f.action == "ignore-range":
            headers = [(k, v) for k, v in headers if k.lower() != "range"]
        if f is not None and f.action == "truncate-body" and self.headers.get("Content-Length") is not None:
            keep = min(f.after, int(self.headers["Content-Length"]))
            cr = re.fullmatch(r"(\d+)-(\d+)", self.headers.get("Content-Range", ""))
            headers = [(k, str(keep) if k.lower() == "content-length" else
                        (f"{int(cr.group(1))}-{int(cr.group(1)) + keep - 1}" if k.lower() == "content-range" and cr
                         else v)) for k, v in headers]
        if f is not None and f.action == "bad206":
            m = re.match(r"bytes=(\d+)-", self.headers["Range"])
            headers = [(k, (f"bytes={int(m.group(1)) + f.shift}-" if k.lower() == "range" and m else v))
                       for k, v in headers]
        uhost, _, uport = p.upstream.rpartition(":")
        up = http.client.HTTPConnection(uhost, int(uport), timeout=300)
        try:
            self._forward(up, headers, f)
        finally:
            up.close()

    def _forward(self, up: http.client.HTTPConnection, headers, f: Fault | None) -> None:
        p = self.proxy
        chunked_in = self.headers.get("Transfer-Encoding", "").lower() == "chunked"
        has_body = int(self.headers.get("Content-Length") or 0) > 0 or chunked_in
        up.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
        for k, v in headers:
            up.putheader(k, v)
        if chunked_in:
            up.putheader("Transfer-Encoding", "chunked")
        up.endheaders()
        received = 0
        t0 = time.monotonic()
        body_fault = f is not None and has_body and f.action in ("reset", "close", "stall")
        if has_body or self.headers.get("Content-Length") is not None:
            for piece in self._body_reader():
                if body_fault and received + len(piece) >= f.after:
                    keep = f.after - received
                    if keep > 0:
                        up.send(piece[:keep])
                    received += max(0, keep)
                    self._record(status=0, sent=0, received=received, fault=f.action)
                    return self._stall(f) if f.action == "stall" else self._cut(f.action)
                self._pace(len(piece), t0, received)
                if f is not None and f.action == "truncate-body" and not chunked_in:
                    piece = piece[:max(0, f.after - received)]
                    received += len(piece)  # (what goes on; the rest is read and dropped)
                    if piece:
                        up.send(piece)
                    continue
                up.send(b"%x\r\n%s\r\n" % (len(piece), piece) if chunked_in else piece)
                received += len(piece)
            if chunked_in:
                up.send(b"0\r\n\r\n")
        r = up.getresponse()
        resp_fault = f if (f is not None and not body_fault and f.action in ("reset", "close", "stall", "short")) \
            else None
        out_headers = [(k, v) for k, v in r.getheaders() if k.lower() not in HOP]
        if p.chunk_min_length and self.command == "POST" and "/blobs/uploads/" in self.path and r.status == 202:
            out_headers.append(("OCI-Chunk-Min-Length", str(p.chunk_min_length)))
        clen = r.getheader("Content-Length")
        if self.command == "HEAD" or r.status in (204, 304) or (r.status < 200):
            r.read()
            self._record(status=r.status, sent=0, received=received, fault=None)
            self.send_response(r.status)
            for k, v in out_headers:
                self.send_header(k, v)
            self.end_headers()
            return
        if clen is None:  # chunked from the registry (small: JSON): sent on with a length
            body = r.read()
            out_headers.append(("Content-Length", str(len(body))))
            pieces = [body[i:i + PIECE] for i in range(0, len(body), PIECE)] or []
        else:
            pieces = None
        short = resp_fault is not None and resp_fault.action == "short"
        entry = self._record(status=r.status, sent=0, received=received,
                             fault=None if f is None or resp_fault is not None else f.action)
        self.send_response(r.status)
        for k, v in out_headers:
            if short and k.lower() == "content-length":
                continue
            self.send_header(k, v)
        if short:
            self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        sent = 0
        t0 = time.monotonic()

        def source():
            if pieces is not None:
                yield from pieces
                return
            while True:
                piece = r.read(PIECE)
                if not piece:
                    return
                yield piece

        for piece in source():
            if resp_fault is not None and sent + len(piece) >= resp_fault.after:
                keep = max(0, resp_fault.after - sent)
                if keep:
                    self._write(piece[:keep], short)
                sent += keep
                entry.update(sent=sent, fault=resp_fault.action)
                if short:
                    self.wfile.write(b"0\r\n\r\n")
                    self.close_connection = True
                    return
                return self._stall(resp_fault) if resp_fault.action == "stall" else self._cut(resp_fault.action)
            self._pace(len(piece), t0, sent)
            sent += len(piece)
            entry["sent"] = sent
            self._write(piece, short)
        if short:
            self.wfile.write(b"0\r\n\r\n")

    def _write(self, data: bytes, chunked: bool) -> None:
        if chunked:
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        else:
            self.wfile.write(data)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description="A fault-injecting HTTP proxy in front of a registry (tests/faultproxy.py)")
    ap.add_argument("--upstream", required=True, help="HOST:PORT of the registry")
    ap.add_argument("--listen", default="127.0.0.1:0", help="HOST:PORT to listen on (port 0: a free one)")
    ap.add_argument("--token-auth", action="store_true", help="demand bearer tokens the proxy issues at /token")
    ap.add_argument("--body-limit", type=int, default=None, help="answer 413 to a request body larger than this")
    ap.add_argument("--rate", type=float, default=None, help="pace bodies to this many bytes per second")
    ap.add_argument("--fault", action="append", default=[], help="a fault as JSON (repeatable)")
    a = ap.parse_args(argv)
    proxy = FaultProxy(a.upstream, a.listen, token_auth=a.token_auth, body_limit=a.body_limit, rate=a.rate)
    proxy.add(*[Fault(**json.loads(x)) for x in a.fault])
    print(f"listening on {proxy.host}", flush=True)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        pass
    finally:
        proxy.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
