"""One kept-alive HTTP connection for tests that send thousands of requests (the fuzz tests), and a
server on a thread for them to send to."""

from __future__ import annotations

import asyncio
import http.client
import threading


class KeptAlive:
    def __init__(self, host: str, port: int, timeout: float = 30):
        self.host, self.port, self.timeout = host, port, timeout
        self.conn: http.client.HTTPConnection | None = None

    def send(self, method: str, path: str, body: bytes | None = None,
             headers: dict | None = None) -> tuple[http.client.HTTPResponse, bytes]:
        """(response, its body), reconnecting once when the server closed the kept-alive connection
        (e.g. after an error)."""
        for attempt in range(2):
            if self.conn is None:
                self.conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
            try:
                self.conn.request(method, path, body=body, headers=headers or {})
                resp = self.conn.getresponse()
                data = resp.read()
                if resp.getheader("Connection", "").lower() == "close":
                    self.close()
                return resp, data
            except (http.client.HTTPException, ConnectionError):
                self.close()
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None


class ThreadedServer:
    """An aiohttp server on its own event loop in a thread, so that hypothesis's synchronous tests
    can talk to it over a KeptAlive connection (`self.http`). A subclass starts it in `serve()`
    (returning its AppRunner and the host and port it listens on), stops what else it started in
    `stop()` (on the loop) and frees what remains in `close()`."""

    wait_s = 30

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self.loop.run_until_complete, args=(self._run(),), daemon=True)
        self.requests = 0

    async def serve(self):
        raise NotImplementedError

    async def stop(self) -> None:
        pass

    def close(self) -> None:
        pass

    async def _run(self) -> None:
        self.stopping = asyncio.Event()
        runner, self.host, self.port = await self.serve()
        self.ready.set()
        await self.stopping.wait()
        await runner.cleanup()
        await self.stop()

    def __enter__(self):
        self.thread.start()
        assert self.ready.wait(self.wait_s), f"{type(self).__name__}: the server did not start"
        self.http = KeptAlive(self.host, self.port, timeout=self.wait_s)
        return self

    def __exit__(self, *exc) -> None:
        self.http.close()
        self.loop.call_soon_threadsafe(self.stopping.set)
        self.thread.join(self.wait_s)
        self.loop.close()
        self.close()
