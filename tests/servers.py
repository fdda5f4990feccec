"""Real servers on loopback, each in its own process, counting the requests they answer.

``python -m tests.servers http <folder> <log>`` serves ``folder`` over HTTP (a GET of a file named
``broken-*`` fails with 503, standing for a store that fails; with ``COORDPREP_SERVER_LATENCY_MS``
set, every request is answered that many milliseconds late, standing for object storage's latency; with
``COORDPREP_SERVER_MBPS`` set, the bodies of all requests share a link of that many MB/s); ``python -m tests.servers
s3 <log>`` runs moto's S3-compatible server. Each prints its port on its first line of stdout,
appends ``<METHOD> <path>`` to ``log`` for every request (the server-side count a test asserts on),
and exits when its stdin closes (the test's end, or the test process dying). :class:`Server` starts
one from a test.
"""

from __future__ import annotations

import collections
import os
import select
import subprocess
import sys
import threading
import time


class Server:
    """A server process of this module, stopped on ``close`` (or as a context manager)."""

    def __init__(self, kind: str, log: str, *args: str, timeout_s: float = 60.0) -> None:
        self.log = log
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        self.process = subprocess.Popen([sys.executable, "-m", "tests.servers", kind, *args, log], cwd=root,
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        ready, _, _ = select.select([self.process.stdout], [], [], timeout_s)
        if not ready:
            self.close()
            raise RuntimeError(f"the {kind} server did not start within {timeout_s} s")
        self.port = int(self.process.stdout.readline())
        self.url = f"http://127.0.0.1:{self.port}"

    def requests(self) -> collections.Counter:
        """``(method, path)`` -> how many times the server answered it so far."""
        if not os.path.exists(self.log):
            return collections.Counter()
        with open(self.log) as f:
            return collections.Counter(tuple(line.split(" ", 1)) for line in f.read().splitlines())

    def close(self) -> None:
        self.process.stdin.close()  # the server's signal to exit
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def __enter__(self) -> "Server":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _record(log: str, method: str, path: str) -> None:
    with open(log, "a") as f:
        f.write(f"{method} {path.split('?', 1)[0]}\n")


def _serve_http(folder: str, log: str):
    from functools import partial
    from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

    latency_s = float(os.environ.get("COORDPREP_SERVER_LATENCY_MS", "0")) / 1000
    rate = float(os.environ.get("COORDPREP_SERVER_MBPS", "0")) * 1e6  # bytes/s of the link every body shares
    link = {"free_at": time.monotonic()}
    link_lock = threading.Lock()

    class Counting(SimpleHTTPRequestHandler):
        def copyfile(self, source, outputfile):
            if not rate:
                return super().copyfile(source, outputfile)
            while chunk := source.read(1 << 16):
                with link_lock:  # this chunk's turn on the link: after every chunk sent before it
                    done = max(time.monotonic(), link["free_at"]) + len(chunk) / rate
                    link["free_at"] = done
                time.sleep(max(0.0, done - time.monotonic()))  # the link's pace (a benchmark's server, not a wait on anyone)
                outputfile.write(chunk)

        def send_head(self):
            _record(log, self.command, self.path)
            if latency_s:
                time.sleep(latency_s)  # the store's latency per request (each request has a thread of its own)
            if self.command == "GET" and "/broken-" in self.path:  # a store failing every GET of it (HEAD answers)
                self.send_error(503, "unavailable")
                return None
            return super().send_head()

        def log_message(self, *args):  # quiet: the count is in the log file
            pass

    class Server(ThreadingHTTPServer):
        request_queue_size = 256  # as a store takes many requests at once (socketserver's 5 drops connections)

    return Server(("127.0.0.1", 0), partial(Counting, directory=folder))


def _serve_s3(log: str):
    import logging

    from moto.server import DomainDispatcherApplication, create_backend_app
    from werkzeug.serving import make_server

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # quiet: the count is in the log file
    app = DomainDispatcherApplication(create_backend_app)

    def counting(environ, start_response):
        _record(log, environ["REQUEST_METHOD"], environ.get("PATH_INFO", ""))
        return app(environ, start_response)

    return make_server("127.0.0.1", 0, counting, threaded=True)


def main(argv: list[str]) -> None:
    kind, *args = argv
    server = _serve_http(*args) if kind == "http" else _serve_s3(*args)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    sys.stdout.write(f"{server.server_address[1]}\n")
    sys.stdout.flush()
    sys.stdin.read()  # until the test closes our stdin
    server.shutdown()


if __name__ == "__main__":
    main(sys.argv[1:])
