"""HTTP servers the remote tests and bench/bench_remote.py start as processes of their own.

`python tests/remote_servers.py range PORT DIR LOG`: RangeHTTPServer's handler serving DIR, each request's byte
count appended to LOG as `bytes\\n` (what the server sent: counted on the server side).
`python tests/remote_servers.py hostile PORT MODE FILE`: a server that misbehaves one way (MODE):
  norange   answers every range request with 200 and the whole file
  wrongrange answers with a 206 of other bytes than asked
  endless   sends a 206 whose body never ends (more than asked)
  trickle   sends a byte a second
  short     closes the connection halfway through the body (truncated)
  notfound  404 for everything
  forbidden 403 for everything
  etag      a new ETag on every answer (the object changes between requests)
MODE:big misbehaves so only for requests of 1 MB or more (tensor data streamed by fix), answering the others well.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def _range_server(port: int, folder: str, log: str) -> None:
    import shutil

    from RangeHTTPServer import RangeRequestHandler, copy_byte_range

    class Counting(RangeRequestHandler):
        def copyfile(self, source, outputfile):  # what RangeHTTPServer sends, counted as it is sent
            class Counter:
                sent = 0

                def write(self, data):
                    Counter.sent += len(data)
                    return outputfile.write(data)

            try:
                if not self.range:
                    return super().copyfile(source, Counter())
                # a range copied in blocks as large as a whole object's (shutil's; RangeHTTPServer's own are 16 KB, 4x
                # the server's work per byte), so a range costs the server what a download of the same bytes does
                return copy_byte_range(source, Counter(), *self.range, bufsize=shutil.COPY_BUFSIZE)
            finally:
                with open(log, "a") as f:
                    f.write(f"{Counter.sent}\n")

        def log_message(self, *args):
            pass

    os.chdir(folder)
    ThreadingHTTPServer(("127.0.0.1", port), Counting).serve_forever()


def _hostile(port: int, how: str, path: str) -> None:
    data = open(path, "rb").read()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        count = 0

        def log_message(self, *args):
            pass

        def do_GET(self):
            Handler.count += 1
            first, last = self.headers.get("Range", "bytes=0-").removeprefix("bytes=").split("-")
            first = int(first)
            last = min(int(last) if last else len(data) - 1, len(data) - 1)
            body = data[first:last + 1]
            mode = how.removesuffix(":big") if not how.endswith(":big") or len(body) >= 1 << 20 else "well"
            if mode in ("notfound", "forbidden"):
                self.send_response(404 if mode == "notfound" else 403)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            if mode == "norange":
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
                return
            self.send_response(206)
            if mode == "wrongrange":
                first, last = first + 1, last + 1
                body = data[first:last + 1]
            self.send_header("Content-Range", f"bytes {first}-{last}/{len(data)}")
            self.send_header("ETag", f'"v{Handler.count}"' if mode == "etag" else '"v1"')
            if mode == "endless":
                self.end_headers()  # no length: the body runs until the connection closes, which it never does
                while True:
                    self.wfile.write(b"\0" * 65536)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if mode == "trickle":
                for i in range(len(body)):
                    self.wfile.write(body[i:i + 1])
                    self.wfile.flush()
                    time.sleep(1)
            elif mode == "short":
                self.wfile.write(body[:len(body) // 2])
                self.wfile.flush()
                self.connection.shutdown(socket.SHUT_RDWR)  # (close() alone leaves the file objects' copies open)
                self.close_connection = True
            else:
                self.wfile.write(body)

    ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()


if __name__ == "__main__":
    kind, port = sys.argv[1], int(sys.argv[2])
    if kind == "range":
        _range_server(port, sys.argv[3], sys.argv[4])
    else:
        _hostile(port, sys.argv[3], sys.argv[4])
