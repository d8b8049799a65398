"""How a blob's bytes are read (vllm_snapshot.fleet.transport._body, net.read_range): one buffer
refilled in place for a plain body (no allocation per chunk, the connection kept for the next
request), ``requests``' own decoding for an encoded one, a file range read the same way. A small
HTTP server on loopback in a thread: no registry, no vLLM."""

from __future__ import annotations

import gzip
import hashlib
import http.server
import os
import threading

import pytest
import requests

from vllm_snapshot.fleet import net, transport

DATA = os.urandom(700_000)


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: one connection may carry several requests
    peers: list = []

    def do_GET(self):  # noqa: N802 - http.server's name
        _Handler.peers.append(self.client_address)
        body, hdrs = DATA, {}
        if self.path == "/gzip":
            body, hdrs = gzip.compress(DATA), {"Content-Encoding": "gzip"}
        if self.path == "/short":  # a body cut short: the length promised, half sent, the connection closed
            self.send_response(200)
            self.send_header("Content-Length", str(len(DATA)))
            self.end_headers()
            self.wfile.write(DATA[:len(DATA) // 2])
            self.close_connection = True
            return
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        for k, v in hdrs.items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *a):
        pass


@pytest.fixture
def server():
    _Handler.peers = []
    s = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    threading.Thread(target=s.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{s.server_address[1]}"
    s.shutdown()
    s.server_close()


def test_a_plain_body_is_read_into_one_buffer_and_the_connection_is_kept(server):
    with requests.Session() as s:
        for _ in range(2):
            r = s.get(server + "/plain", stream=True)
            chunks, got, buffers = 0, bytearray(), set()
            for c in transport._body(r):
                assert isinstance(c, memoryview) and 0 < len(c) <= net.CHUNK
                buffers.add(id(c.obj))
                got += c  # the sink copies: the next chunk overwrites the buffer
                chunks += 1
            r.close()
            assert bytes(got) == DATA
            assert chunks >= len(DATA) // net.CHUNK and len(buffers) == 1  # refilled in place
    # both requests went over one connection (the body read to its end handed it back)
    assert len(_Handler.peers) == 2 and _Handler.peers[0] == _Handler.peers[1]


def test_a_body_cut_short_ends_quietly_and_the_next_request_gets_a_new_connection(server):
    """The caller sees fewer bytes than promised, without an error here (get_blob asks again
    from the byte reached); the next request goes over a new connection and gets its body."""
    with requests.Session() as s:
        r = s.get(server + "/short", stream=True)
        n = sum(len(c) for c in transport._body(r))
        r.close()
        assert n == len(DATA) // 2
        r = s.get(server + "/plain", stream=True)
        got = b"".join(bytes(c) for c in transport._body(r))
        r.close()
    assert got == DATA and len(_Handler.peers) == 2 and _Handler.peers[0] != _Handler.peers[1]


def test_an_encoded_body_is_decoded_by_requests(server):
    r = requests.get(server + "/gzip", stream=True)
    got = b"".join(bytes(c) for c in transport._body(r))
    r.close()
    assert got == DATA  # gzip undone; a reused raw buffer would have handed over the compressed bytes


def test_get_blob_hashes_the_chunks_it_hands_over(server, monkeypatch):
    """Through Registry.get_blob: the digest is checked over exactly the bytes the sink saw."""
    from vllm_snapshot.fleet.reference import RegistryRef

    reg = transport.Registry(RegistryRef(host=server.split("//")[1], repo="r", tag="t"), plain_http=True)
    monkeypatch.setattr(reg, "base", server + "/plain?")  # GET {base}blobs/DIGEST -> the plain body
    got = bytearray()
    assert reg.get_blob("sha256:" + hashlib.sha256(DATA).hexdigest(), len(DATA), got.extend, "x") == len(DATA)
    assert bytes(got) == DATA


def test_read_range_reads_a_files_range_into_one_buffer(tmp_path):
    p = tmp_path / "f"
    p.write_bytes(DATA)
    views = list(net.read_range(p, 1234, 500_000))
    assert all(isinstance(v, memoryview) for v in views) and len({id(v.obj) for v in views}) == 1
    got = bytearray()
    for v in net.read_range(p, 1234, 500_000):
        got += v
    assert bytes(got) == DATA[1234:501234]
    # a range past the end gives what the file holds, then stops
    assert sum(len(v) for v in net.read_range(p, len(DATA) - 10, 100)) == 10
