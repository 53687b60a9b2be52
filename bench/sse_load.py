"""Closed-loop load of streamed completions: N clients, each on its own keep-alive connection,
sending the next request as soon as the previous stream ends.

One asyncio event loop on raw sockets (HTTP/1.1, chunked Server-Sent Events): per event it
only splits the bytes and, for the first text and the last chunk, parses JSON, so at 64 streams
it costs the server under test far less CPU than a thread per stream with `requests` would.
Every server measured with it (this project's, the Hugging Face peer) is read the same way.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import Any

from bench.common import median, percentile


@dataclass
class StreamResult:
    tokens: int
    ttft_ms: float  # NaN when the answer has no text (its first token ended it)
    tpot_ms: float  # per output token after the first; NaN with one token


async def _read_head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    status = int((await reader.readline()).split()[1])
    headers = {}
    while (line := await reader.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    return status, headers


async def _body_chunks(reader: asyncio.StreamReader, headers: dict[str, str]):
    if headers.get("transfer-encoding", "").lower() != "chunked":
        yield await reader.readexactly(int(headers.get("content-length", "0")))
        return
    while True:
        size = int((await reader.readline()).split(b";")[0], 16)
        if size == 0:
            await reader.readline()
            return
        data = await reader.readexactly(size)
        await reader.readline()
        yield data


class Connection:
    def __init__(self, host: str, port: int):
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def stream(
        self, path: str, body: dict[str, Any], timeout_s: float = 300
    ) -> StreamResult | None:
        """One streamed completion; None when refused, broken or not done in `timeout_s` (the
        connection is then reopened)."""
        try:
            return await asyncio.wait_for(self._stream(path, body), timeout_s)
        except TimeoutError:
            self.close()
            return None

    async def _stream(self, path: str, body: dict[str, Any]) -> StreamResult | None:
        if self.writer is None or self.writer.is_closing():
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        assert self.reader is not None
        payload = json.dumps(body).encode()
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
        )
        start = time.perf_counter()
        self.writer.write(head.encode() + payload)
        try:
            status, headers = await _read_head(self.reader)
            first = last = None
            tokens, finished, buffer = 0, False, b""
            async for data in _body_chunks(self.reader, headers):
                buffer += data
                *events, buffer = buffer.split(b"\n\n")
                for event in events:
                    if not event.startswith(b"data: {"):
                        continue
                    if b'"usage"' in event:
                        usage = json.loads(event[6:]).get("usage") or {}
                        tokens = usage.get("completion_tokens", tokens)
                        finished = True
                    if first is None and _has_text(event):
                        first = time.perf_counter()
                    last = time.perf_counter()
            if headers.get("connection", "").lower() == "close":
                self.close()
        except (ConnectionError, asyncio.IncompleteReadError, ValueError, IndexError):
            self.close()
            return None
        if status != 200 or not (first or finished):
            return None
        if first is None or last is None:  # a sampled end of text as the first token
            return StreamResult(tokens, float("nan"), float("nan"))
        tpot = 1000 * (last - first) / (tokens - 1) if tokens > 1 else float("nan")
        return StreamResult(tokens, 1000 * (first - start), tpot)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.writer = None


def _has_text(event: bytes) -> bool:
    choices = json.loads(event[6:]).get("choices") or []
    return any(c.get("text") or (c.get("delta") or {}).get("content") for c in choices)


async def _load(
    host: str, port: int, path: str, body: dict[str, Any], clients: int, seconds: float
) -> tuple[list[StreamResult], int, float]:
    done: list[StreamResult] = []
    failed = [0]
    stop = time.perf_counter() + seconds

    async def client(k: int) -> None:
        connection, seed = Connection(host, port), 1000 * k
        try:
            while time.perf_counter() < stop:
                seed += 1
                result = await connection.stream(path, {**body, "seed": seed})
                if result is None:
                    failed[0] += 1
                    await asyncio.sleep(0.05)
                else:
                    done.append(result)
        finally:
            connection.close()

    start = time.perf_counter()
    await asyncio.gather(*(client(k) for k in range(clients)))
    return done, failed[0], time.perf_counter() - start


def load(
    host: str, port: int, path: str, body: dict[str, Any], clients: int, seconds: float
) -> dict[str, Any]:
    """`clients` closed-loop streams for `seconds` (each request's `seed` its own): output
    tokens/s over all of them (from each answer's usage), TTFT p50/p99, TPOT p50."""
    done, failed, elapsed = asyncio.run(_load(host, port, path, body, clients, seconds))
    ttfts = [d.ttft_ms for d in done if d.ttft_ms == d.ttft_ms]
    tpots = [d.tpot_ms for d in done if d.tpot_ms == d.tpot_ms]
    return {
        "clients": clients,
        "completions": len(done),
        "failed": failed,
        "tokens_per_s": sum(d.tokens for d in done) / elapsed,
        "ttft_p50_ms": median(ttfts) if ttfts else float("nan"),
        "ttft_p99_ms": percentile(ttfts, 99) if ttfts else float("nan"),
        "tpot_p50_ms": median(tpots) if tpots else float("nan"),
    }
