"""Requests per second and latency of GET /v1/best on loopback.

    python -m bench.service [--winners 10000] [--clients 100] [--seconds 8]
                            [--rates 500,1000,2000,4000] [--workers 1] [--out bench/results]

Fills a temporary SQLite database with `--winners` winners through `Store`
(two devices of sm90, one measured and one modeled, ten M values per (N, K)),
starts `tuner serve` on a free loopback port and drives it with `--clients`
keep-alive connections cycling through `--queries` distinct queries, in phases:

- cold: every query once, closed loop (every client sends its next request
  when the previous answer arrives): nothing is cached yet;
- warm, closed loop for `--seconds`: the server runs flat out; this is its
  throughput, and latency is then the queue (clients / throughput, Little's
  law);
- warm, open loop for `--seconds` at each rate of `--rates`: the clients
  together send that many requests per second on a fixed schedule, and
  latency is taken from each request's scheduled send time, so a stalled
  server cannot hide its queue.

The queries mix exact keys (70%), M values between tuned ones (20%) and keys
with no winner (10%, answered 404); half name the device. The load average
before and after is recorded: other work on the host shows in the tails. The client speaks
HTTP/1.1 over asyncio streams itself: an HTTP library costs more CPU per
request than the server, and client and server share this host's cores.
Writes `<out>/<host-slug>-service.json`.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import platform
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import urlencode

from bench.kernels_sm90 import device_slug
from bench.record import save

DEVICES = (("NVIDIA H100 80GB HBM3", "gpu", {"torch": "2.13.0", "cutlass-dsl": "4.8.1"}),
           ("H100-model", "model", {"model": "1"}))
M_VALUES = (1, 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
CONFIG = {"arch": "sm90", "scheduler": "dynamic_persistent", "tile_m": 128, "tile_n": 256, "cluster_m": 2,
          "cluster_n": 1, "stages": 4, "swizzle": 4, "raster": "m", "sched_depth": 2, "tail_cancel": False,
          "split_k": 1, "cta_group": 1, "acc_stages": 1}
START_TIMEOUT_S = 60


def families(count: int) -> list[tuple[int, int]]:
    """`count` distinct (N, K) pairs, multiples of 128 as model projections are."""
    rng = random.Random(0)
    out: set[tuple[int, int]] = set()
    while len(out) < count:
        out.add((128 * rng.randint(8, 384), 128 * rng.randint(8, 384)))
    return sorted(out)


def fill(url: str, winners: int) -> list[tuple[int, int]]:
    """Store `winners` winners; returns the (N, K) families."""
    from db.store import Store

    store = Store(url)
    per_family = len(DEVICES) * len(M_VALUES)
    nk = families(max(1, winners // per_family))
    envs = [store.environment(backend, "sm90", dev, versions) for dev, backend, versions in DEVICES]
    stored = 0
    for n, k in nk:
        for (dev, _backend, _versions), env in zip(DEVICES, envs, strict=True):
            for m in M_VALUES:
                if stored == winners:
                    break
                key = {"arch": "sm90", "device": dev, "dtype_in": "bf16", "dtype_out": "bf16", "layout": "tn",
                       "m": m, "n": n, "k": k, "groups": 1, "group_k": [], "carveout": 0}
                ms = 1e-6 * m * n * k / 600
                store.set_winner(
                    store.key_id(key, f"bench-{n}x{k}"), env, config_name="sm90-bench", scheduler="dynamic_persistent",
                    config=CONFIG, ms=ms, baseline_ms=ms * 1.1, best_by_scheduler={"dynamic_persistent": ms},
                    trials=24,
                )
                stored += 1
    store.close()
    return nk


def queries(nk: list[tuple[int, int]], count: int, seed: int = 1) -> list[str]:
    """`count` distinct /v1/best paths in a fixed random order."""
    rng = random.Random(seed)
    out: dict[str, None] = {}
    while len(out) < count:
        n, k = rng.choice(nk)
        roll = rng.random()
        if roll < 0.7:
            m = rng.choice(M_VALUES)
        elif roll < 0.9:
            m = rng.randint(2, 8000)
        else:
            n, m = n + 8, rng.choice(M_VALUES)  # no family has an N that is not a multiple of 128
        params = {"m": m, "n": n, "k": k}
        if rng.random() < 0.5:
            params["device"] = DEVICES[0][0]
        out["/v1/best?" + urlencode(params)] = None
    return list(out)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(db: str, port: int, workers: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "tuner.cli", "serve", "--port", str(port), "--db", db, "--workers", str(workers)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {proc.stderr.read()}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2) as s:
                s.sendall(b"GET /healthz HTTP/1.1\r\nHost: bench\r\n\r\n")
                if s.recv(64).startswith(b"HTTP/1.1 200"):
                    return proc
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("server did not answer /healthz in time")


async def _request(reader, writer, path: str) -> int:
    writer.write(f"GET {path} HTTP/1.1\r\nHost: bench\r\n\r\n".encode())
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    length = next(int(line.split(":", 1)[1]) for line in lines if line.lower().startswith("content-length:"))
    await reader.readexactly(length)
    return status


async def _drive(port: int, paths: list[str], clients: int, seconds: float | None, rate: float | None) -> dict:
    """One phase: closed loop when `rate` is None; `seconds` None sends every path once."""
    latencies: list[float] = []
    statuses: dict[int, int] = {}
    conns = [await asyncio.open_connection("127.0.0.1", port) for _ in range(clients)]
    start = time.perf_counter() + 0.05
    end = start + seconds if seconds else float("inf")
    period = clients / rate if rate else 0.0

    async def client(i: int, reader, writer) -> None:
        due = start + period * i / clients
        for j in itertools.count(i, clients):
            if seconds is None and j >= len(paths):
                return
            sent = due if rate else time.perf_counter()
            if sent >= end:
                return
            if rate:
                await asyncio.sleep(max(0.0, due - time.perf_counter()))
                due += period
            status = await _request(reader, writer, paths[j % len(paths)])
            latencies.append(time.perf_counter() - sent)
            statuses[status] = statuses.get(status, 0) + 1

    await asyncio.gather(*(client(i, r, w) for i, (r, w) in enumerate(conns)))
    elapsed = time.perf_counter() - start
    for _, w in conns:
        w.close()
    lat = sorted(latencies)
    q = statistics.quantiles(lat, n=100, method="inclusive")
    return {
        "offered_rps": rate, "clients": clients, "seconds": round(elapsed, 3),
        "requests": len(lat), "rps": round(len(lat) / elapsed, 1),
        "p50_ms": round(q[49] * 1e3, 3), "p90_ms": round(q[89] * 1e3, 3), "p99_ms": round(q[98] * 1e3, 3),
        "max_ms": round(lat[-1] * 1e3, 3), "statuses": {str(k): v for k, v in sorted(statuses.items())},
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--winners", type=int, default=10_000)
    parser.add_argument("--clients", type=int, default=100)
    parser.add_argument("--seconds", type=float, default=8.0, help="Length of each warm phase.")
    parser.add_argument("--queries", type=int, default=5000, help="Distinct queries the clients cycle through.")
    parser.add_argument("--rates", default="500,1000,2000,4000",
                        help="Open-loop requests per second, all clients together, comma-separated.")
    parser.add_argument("--workers", type=int, default=1, help="Server processes.")
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args(argv)

    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        db = str(Path(tmp) / "bench.db")
        started = time.perf_counter()
        nk = fill(db, args.winners)
        fill_s = time.perf_counter() - started
        port = free_port()
        server = start_server(db, port, args.workers)
        try:
            paths = queries(nk, args.queries)
            phases = [{"phase": "cold: every query once, closed loop",
                       **asyncio.run(_drive(port, paths, args.clients, None, None))},
                      {"phase": "warm, closed loop",
                       **asyncio.run(_drive(port, paths, args.clients, args.seconds, None))}]
            for rate in (float(r) for r in args.rates.split(",")):
                phases.append({"phase": f"warm, open loop at {rate:g}/s",
                               **asyncio.run(_drive(port, paths, args.clients, args.seconds, rate))})
        finally:
            server.terminate()
            server.wait(timeout=30)
    host = socket.gethostname()
    result = {
        "host": host, "cpus": os.cpu_count(), "load_before": load_before, "load_after": os.getloadavg(), "python": platform.python_version(), "winners": args.winners,
        "families": len(nk), "queries": len(paths), "workers": args.workers, "fill_seconds": round(fill_s, 1),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S"), "phases": phases,
    }
    save(result, args.out, f"{device_slug(host)}-service")
    return result


if __name__ == "__main__":
    main()
