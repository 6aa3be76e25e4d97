"""regen's HTTP/1.1 transport against real servers on loopback: the simulator (uvicorn, as SGLang
and vLLM serve), and small asyncio servers for the framings and failures uvicorn does not show."""

from __future__ import annotations

import asyncio
import contextlib

import httpx2
import pytest

from regen.transport import StreamTransport
from regen.servers.probe import free_port_base


@contextlib.asynccontextmanager
async def raw_server(handler, tls=None):
    """An asyncio TCP server on loopback (TLS with the ``tls`` context) running
    ``handler(reader, writer)`` per connection; yields (port, list of connections seen)."""
    connections = []

    async def serve(reader, writer):
        connections.append(writer)
        try:
            await handler(reader, writer)
        finally:
            writer.close()

    port = free_port_base(1)
    server = await asyncio.start_server(serve, "127.0.0.1", port, ssl=tls)
    try:
        yield port, connections
    finally:
        server.close()
        await server.wait_closed()


async def read_request(reader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                   if line.lower().startswith(b"content-length")), 0)
    return head + await reader.readexactly(length)


def test_requests_reuse_kept_alive_connections_and_never_exceed_the_slots(tiny_model):
    import subprocess
    import sys

    port = free_port_base(1)
    sim = subprocess.Popen([sys.executable, "-m", "regen", "sim", "--port", str(port), "--model-path",
                            str(tiny_model), "--sim-tokens-per-second", "2000"])
    from regen.servers.lifecycle import wait_healthy
    from regen.servers.records import ServerRecord

    try:
        wait_healthy([(ServerRecord(0, None, "127.0.0.1", port, sim.pid, "/dev/null", None), sim)], 30)

        async def main():
            transport = StreamTransport("127.0.0.1", port, 4)
            body = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 64}'
            results = await asyncio.gather(*(transport.request("POST", "/v1/chat/completions", body)
                                             for _ in range(40)))
            opened = len(transport._idle)
            metrics = await transport.request("GET", "/metrics")
            await transport.aclose()
            return results, opened, metrics

        results, opened, (status, metrics) = asyncio.run(main())
        assert [s for s, _ in results] == [200] * 40
        assert all(b'"reasoning_content"' in body for _, body in results)
        assert opened == 4  # 40 requests over the 4 connections the slots allow
        assert status == 200 and b"sglang:num_requests_total" in metrics
    finally:
        sim.terminate()
        sim.wait(timeout=10)


def test_chunked_and_close_framed_responses_are_read_whole():
    async def handler(reader, writer):
        request = await read_request(reader)
        if b"/chunked" in request:
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
                         b"5\r\nhello\r\n6;ext=1\r\n world\r\n0\r\nX-Trailer: 1\r\n\r\n")
        else:
            writer.write(b"HTTP/1.1 503 Service Unavailable\r\nConnection: close\r\n\r\nwarming up")
        await writer.drain()
        if b"/chunked" in request:
            await read_request(reader)  # kept alive: the next request comes on this connection
            writer.write(b"HTTP/1.1 204 No Content\r\n\r\n")
            await writer.drain()

    async def main():
        async with raw_server(handler) as (port, connections):
            transport = StreamTransport("127.0.0.1", port, 1)
            assert await transport.request("GET", "/chunked") == (200, b"hello world")
            assert await transport.request("GET", "/again") == (204, b"")
            assert len(connections) == 1
            assert await transport.request("GET", "/close") == (503, b"warming up")
            assert len(transport._idle) == 0  # the server said close
            await transport.aclose()

    asyncio.run(main())


def test_an_idle_connection_the_server_closed_is_replaced_without_an_error():
    async def handler(reader, writer):
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()  # then close: a keep-alive timeout on the server's side

    async def main():
        async with raw_server(handler) as (port, connections):
            transport = StreamTransport("127.0.0.1", port, 1)
            assert await transport.request("GET", "/") == (200, b"ok")
            await asyncio.sleep(0)  # the server's FIN reaches the idle connection
            assert await transport.request("GET", "/") == (200, b"ok")
            assert len(connections) == 2
            await transport.aclose()

    asyncio.run(main())


def test_failures_are_httpx2_exceptions():
    async def silent(reader, writer):
        await read_request(reader)
        await asyncio.sleep(30)

    async def hang_up(reader, writer):
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\ncut")

    async def main():
        refused = StreamTransport("127.0.0.1", free_port_base(1), 1)
        with pytest.raises(httpx2.ConnectError):
            await refused.request("GET", "/")
        async with raw_server(silent) as (port, _):
            with pytest.raises(httpx2.ReadTimeout):
                await StreamTransport("127.0.0.1", port, 1, read_timeout=0.3).request("GET", "/")
        async with raw_server(hang_up) as (port, _):
            with pytest.raises(httpx2.RemoteProtocolError, match="inside the response"):
                await StreamTransport("127.0.0.1", port, 1).request("GET", "/")

    asyncio.run(main())


def test_it_is_an_httpx2_transport():
    async def handler(reader, writer):
        request = await read_request(reader)
        assert b"Authorization: Bearer k" in request
        writer.write(b'HTTP/1.1 200 OK\r\nContent-Length: 11\r\n\r\n{"ok":true}')
        await writer.drain()

    async def main():
        async with raw_server(handler) as (port, _):
            transport = StreamTransport("127.0.0.1", port, 1, headers={"Authorization": "Bearer k"})
            async with httpx2.AsyncClient(transport=transport) as client:
                response = await client.post(f"http://127.0.0.1:{port}/v1/x", json={"a": 1})
            assert response.status_code == 200 and response.json() == {"ok": True}

    asyncio.run(main())


def test_https_is_spoken_over_tls_and_a_certificate_that_does_not_verify_is_refused(tmp_path, monkeypatch):
    """An https endpoint gets TLS (the key never crosses in clear), the server's certificate
    verified: trusted through SSL_CERT_FILE it answers, untrusted the connection is refused."""
    import ssl
    import subprocess

    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    seen = []

    async def handler(reader, writer):
        seen.append(await read_request(reader))
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()

    async def main(trusted: bool):
        async with raw_server(handler, tls=context) as (port, _):
            if trusted:
                monkeypatch.setenv("SSL_CERT_FILE", str(cert))
            else:
                monkeypatch.delenv("SSL_CERT_FILE", raising=False)
            transport = StreamTransport("127.0.0.1", port, 1, tls=True, headers={"Authorization": "Bearer k-123"})
            try:
                return await transport.request("GET", "/health")
            finally:
                await transport.aclose()

    with pytest.raises(httpx2.ConnectError, match="TLS: CERTIFICATE_VERIFY_FAILED"):
        asyncio.run(main(trusted=False))
    assert asyncio.run(main(trusted=True)) == (200, b"ok")
    assert b"Authorization: Bearer k-123" in seen[-1]  # read by the TLS server: it was sent encrypted
