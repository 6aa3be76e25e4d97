"""HTTP/1.1 keep-alive connections to one server over asyncio streams.

Why regen has its own transport: on a node whose cores the engine keeps busy, every CPU
millisecond and event-loop turn the client spends per request is taken from the engine's own HTTP
front end. Against vLLM on two cores, with the server as regen starts it, a bare httpx 0.28
client delivered 0.77x to 0.82x of this transport, round after round, and the front end spent
more CPU per run for it: the work each request costs in its layers (URL parsing, request and
response models, a pool with locks and events, three sends per request). This transport writes each request with one
`write` and reads the response with one header read and one body read, on connections kept alive
per request slot.

It speaks the subset engines use: one origin (http, or https with the certificate verified), a body of known length, responses framed by
Content-Length or chunked encoding, keep-alive unless the server says close. Failures are
httpx2's exceptions (ConnectError, ReadTimeout, RemoteProtocolError, ...), and it is also an
httpx2 transport (``httpx2.AsyncClient(transport=...)``) for code that wants httpx's models.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections import deque

import httpx2


class StreamTransport(httpx2.AsyncBaseTransport):
    """Up to ``max_connections`` kept-alive connections to ``host:port``."""

    def __init__(self, host: str, port: int, max_connections: int, connect_timeout: float = 10.0,
                 read_timeout: float | None = None, headers: dict[str, str] | None = None, tls: bool = False):
        self.host, self.port = host, port
        # https: TLS with the certificate verified against the system's CAs (or SSL_CERT_FILE's)
        self.ssl = ssl.create_default_context() if tls else None
        self.connect_timeout, self.read_timeout = connect_timeout, read_timeout
        self._default_headers = b"".join(f"{k}: {v}\r\n".encode() for k, v in {
            "Host": f"{host}:{port}", **(headers or {})}.items())
        self._idle: deque[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = deque()
        self._slots = asyncio.Semaphore(max_connections)
        self._closed = False

    async def request(self, method: str, target: str, body: bytes = b"", content_type: str = "application/json",
                      read_timeout: float | None = None) -> tuple[int, bytes]:
        """(status, body) of one request. A reused connection the server closed meanwhile is
        replaced once, transparently; any other failure is an httpx2 exception."""
        head = [f"{method} {target} HTTP/1.1\r\n".encode(), self._default_headers]
        if body or method in ("POST", "PUT", "PATCH"):
            head.append(f"Content-Type: {content_type}\r\nContent-Length: {len(body)}\r\n".encode())
        message = b"".join(head) + b"\r\n" + body
        timeout = self.read_timeout if read_timeout is None else read_timeout
        async with self._slots:
            for attempt in (0, 1):
                (reader, writer), reused = await self._connection()
                try:
                    writer.write(message)
                    async with asyncio.timeout(timeout):  # never wait_for: it can lose a cancellation
                        status, content, keep = await _response(reader)
                except _StaleConnection:
                    writer.close()
                    if reused and attempt == 0:
                        continue
                    raise httpx2.RemoteProtocolError("server closed the connection without a response") from None
                except TimeoutError:
                    writer.close()
                    raise httpx2.ReadTimeout(f"no response within {timeout:.0f} s") from None
                except asyncio.IncompleteReadError:
                    writer.close()
                    raise httpx2.RemoteProtocolError("connection closed inside the response") from None
                except (ConnectionError, OSError) as exc:
                    writer.close()
                    raise httpx2.ReadError(str(exc) or type(exc).__name__) from exc
                except BaseException:
                    writer.close()
                    raise
                if keep and not self._closed:
                    self._idle.append((reader, writer))
                else:
                    writer.close()
                return status, content
        raise AssertionError("unreachable")

    async def _connection(self):
        while self._idle:
            reader, writer = self._idle.pop()
            if reader.at_eof() or writer.is_closing():
                writer.close()
                continue
            return (reader, writer), True
        try:
            async with asyncio.timeout(self.connect_timeout):
                conn = await asyncio.open_connection(self.host, self.port, ssl=self.ssl)
        except TimeoutError:
            raise httpx2.ConnectTimeout(f"connecting to {self.host}:{self.port} timed out") from None
        except ssl.SSLError as exc:  # a certificate that does not verify is no transient failure
            raise httpx2.ConnectError(f"{self.host}:{self.port}: TLS: {exc.reason or exc}") from exc
        except OSError as exc:
            raise httpx2.ConnectError(f"{self.host}:{self.port}: {exc.strerror or exc}") from exc
        return conn, False

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        """The httpx2 transport interface, over :meth:`request` (for httpx2.AsyncClient)."""
        timeouts = request.extensions.get("timeout", {})
        status, content = await self.request(
            request.method, request.url.raw_path.decode("ascii"), await request.aread(),
            request.headers.get("content-type", "application/json"), timeouts.get("read"))
        return httpx2.Response(status, content=content, request=request)

    async def aclose(self) -> None:
        self._closed = True
        while self._idle:
            _, writer = self._idle.pop()
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()


class _StaleConnection(Exception):
    """End of stream before the first byte of a response."""


async def _response(reader: asyncio.StreamReader) -> tuple[int, bytes, bool]:
    """(status, body, keep-alive) of one response."""
    try:
        raw = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError as exc:
        if not exc.partial:
            raise _StaleConnection() from None
        raise
    except asyncio.LimitOverrunError:
        raise httpx2.RemoteProtocolError("response headers too long") from None
    lines = raw[:-4].split(b"\r\n")
    try:
        version, code = lines[0].split(b" ", 2)[:2]
        status = int(code)
    except ValueError:
        raise httpx2.RemoteProtocolError(f"bad status line {lines[0][:80]!r}") from None
    length, chunked, close = None, False, version == b"HTTP/1.0"
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        name = name.strip().lower()
        if name == b"content-length":
            length = int(value)
        elif name == b"transfer-encoding":
            chunked = b"chunked" in value.lower()
        elif name == b"connection":
            close = value.strip().lower() == b"close"
    if chunked:
        return status, await _chunked(reader), not close
    if length is not None:
        return status, await reader.readexactly(length), not close
    if status in (204, 304) or 100 <= status < 200:
        return status, b"", not close
    return status, await reader.read(), False  # framed by the end of the connection


async def _chunked(reader: asyncio.StreamReader) -> bytes:
    parts = []
    while True:
        size = int((await reader.readuntil(b"\r\n")).split(b";", 1)[0].strip() or b"0", 16)
        if size == 0:
            while (await reader.readuntil(b"\r\n")) != b"\r\n":  # trailers
                pass
            return b"".join(parts)
        parts.append(await reader.readexactly(size))
        await reader.readexactly(2)
