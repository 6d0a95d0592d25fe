"""A tiny HTTP server for testing the harness: `python -m lora_devcluster.echoserver`.

GET /healthz -> 200 "ok"; GET /env -> the environment as JSON; GET /file?path=P -> the file's
bytes (404 if missing); GET /ls?path=D -> the directory's entries as JSON; anything else ->
200 with the hostname. Listens on 0.0.0.0:$PORT (default 8080). Standard library only, so it
starts fast.
"""

from __future__ import annotations

import http.server
import json
import os
import socket
import urllib.parse


class Handler(http.server.BaseHTTPRequestHandler):
    def _send(self, code: int, body: bytes, ctype: str = "text/plain") -> None:
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        url = urllib.parse.urlparse(self.path)
        if url.path == "/healthz":
            self._send(200, b"ok")
        elif url.path == "/env":
            self._send(200, json.dumps(dict(os.environ)).encode(), "application/json")
        elif url.path == "/ls":
            path = urllib.parse.parse_qs(url.query).get("path", [""])[0]
            try:
                self._send(200, json.dumps(sorted(os.listdir(path))).encode(), "application/json")
            except OSError as e:
                self._send(404, str(e).encode())
        elif url.path == "/file":
            path = urllib.parse.parse_qs(url.query).get("path", [""])[0]
            try:
                with open(path, "rb") as f:
                    self._send(200, f.read(), "application/octet-stream")
            except OSError as e:
                self._send(404, str(e).encode())
        else:
            self._send(
                200, socket.gethostname().encode() + b" " + os.environ.get("HOSTNAME", "").encode()
            )

    def log_message(self, format: str, *args: object) -> None:
        print(f"{self.address_string()} {format % args}", flush=True)


def main() -> None:
    port = int(os.environ.get("PORT", "8080"))
    server = http.server.ThreadingHTTPServer(("0.0.0.0", port), Handler)
    print(f"echoserver listening on 0.0.0.0:{port}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
