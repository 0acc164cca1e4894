"""One kept-alive HTTP connection for tests that send thousands of requests (the fuzz tests)."""

from __future__ import annotations

import http.client


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
