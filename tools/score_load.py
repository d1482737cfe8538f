#!/usr/bin/env python3
"""Sustained client load on an `opd serve` teacher (docs/robustness.md, "Session 17: long runs").

--workers threads POST small JSON /v1/score requests (random token ids below --vocab, K 4) to
--url for --duration seconds: --keepalive of them over one persistent connection each (HTTP/1.1
keep-alive), the others over a new connection per request (closed after the answer); every
--abandon-th request of a new-connection worker sends half a request and closes the socket
without waiting (a client that gives up). Prints requests, answers by status, transport errors
and the rate, every 30 s and at the end; run tools/soak_probe.py --pid <server pid> beside it to
see the server's threads, descriptors and memory.

    python3 tools/score_load.py --url http://127.0.0.1:8000 --workers 6 --keepalive 3 --duration 300
"""
import argparse
import http.client
import json
import random
import socket
import threading
import time
import urllib.parse


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", required=True)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--keepalive", type=int, default=2, help="workers that reuse one connection")
    ap.add_argument("--duration", type=float, default=60)
    ap.add_argument("--vocab", type=int, default=272)
    ap.add_argument("--length", type=int, default=12, help="tokens per sequence")
    ap.add_argument("--abandon", type=int, default=10, help="every N-th new-connection request is abandoned (0: never)")
    a = ap.parse_args()
    u = urllib.parse.urlparse(a.url)
    host, port = u.hostname, u.port or 80
    lock = threading.Lock()
    counts = {}
    end = time.time() + a.duration

    def count(key):
        with lock:
            counts[key] = counts.get(key, 0) + 1

    def body(rng):
        ids = [rng.randrange(a.vocab) for _ in range(a.length)]
        return json.dumps({"k": 4, "sequences": [{"ids": ids, "begin": 2}]})

    def worker(i, keepalive):
        rng = random.Random(i)
        conn = None
        n = 0
        while time.time() < end:
            n += 1
            if not keepalive and a.abandon and n % a.abandon == 0:
                try:
                    s = socket.create_connection((host, port), timeout=5)
                    s.sendall(b"POST /v1/score HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                              b"Content-Length: 100\r\n\r\n{\"k\": 4")
                    s.close()
                    count("abandoned")
                except OSError:
                    count("transport_error")
                continue
            try:
                if conn is None:
                    conn = http.client.HTTPConnection(host, port, timeout=30)
                conn.request("POST", "/v1/score", body(rng), {"Content-Type": "application/json",
                                                              "Accept": "application/json"})
                r = conn.getresponse()
                r.read()
                count(f"http_{r.status}")
                if not keepalive or r.getheader("Connection", "").lower() == "close":
                    conn.close()
                    conn = None
            except (OSError, http.client.HTTPException):
                count("transport_error")
                if conn is not None:
                    conn.close()
                conn = None

    threads = [threading.Thread(target=worker, args=(i, i < a.keepalive), daemon=True) for i in range(a.workers)]
    t0 = time.time()
    for t in threads:
        t.start()
    next_report = t0 + 30
    while any(t.is_alive() for t in threads):
        time.sleep(0.5)
        if time.time() >= next_report:
            with lock:
                print(f"{time.time() - t0:.0f} s: {dict(sorted(counts.items()))}", flush=True)
            next_report += 30
    total = sum(v for k, v in counts.items() if k.startswith("http_"))
    secs = time.time() - t0
    print(f"done after {secs:.0f} s: {dict(sorted(counts.items()))}; {total / secs:.1f} answered requests/s")


if __name__ == "__main__":
    main()
