"""Gateway overhead benchmark: the same streams sent directly to a mock worker and through the gateway.

Three processes on this machine: the in-repo mock worker (`tests.fixtures.mock_upstream`, streaming
at a fixed token rate), the gateway (`probex gateway`, with a policy that judges every
chunk), and this load generator. Scenarios:

- sequential: one stream at a time, 16 tokens at 400 tokens/s;
- light: 4 streams in flight at once, same streams;
- concurrent: 128 streams in flight at once, 64 tokens each at 20 tokens/s per stream
  (2,560 content events a second in all). A GPU serving 64-128 concurrent streams delivers
  roughly 20-100 tokens/s to each, and at this rate the three processes together stay well
  inside 2 cores, so the numbers describe the gateway rather than a CPU queue. The 128
  clients start at random offsets within one stream's duration, so their streams overlap
  at random phases instead of all starting in the same millisecond.

The load generator speaks HTTP/1.1 itself on asyncio sockets (one keep-alive connection per
client, each request in one write, server-sent events read as they arrive and stamped with
the time their bytes reached the process): httpx costs several times more CPU per event, and
at 128 streams it was the bottleneck.

The mock stamps each chunk with when the request reached it and when it sent the chunk
(`--timestamps`, CLOCK_MONOTONIC, comparable across processes), which gives per request:

- TTFT: request written -> first content chunk read (what a caller sees);
- TTFT transit: TTFT minus the mock's own time between the request and the first token,
  i.e. the time on the wire and in the servers in both directions;
- chunk delivery: mock sent a content chunk -> load generator read it, for every chunk
  (the relay cost per chunk when through the gateway);
- chunk gap: time between content chunks as read.

"added" is the gateway percentile minus the direct percentile. Direct and gateway runs
alternate in rounds so that drift in the machine affects both alike. The gateway's own
measurement of time spent inside it (`probex_gateway_overhead_seconds`, upstream waits
excluded) is read from /metrics around the timed streams (warm-up streams excluded). Last, the policy file is edited 10 times (alternating a
block-everything rule and the normal policy) and the time from save to the first response
decided under the new version is recorded. CPU time of each process, of everything else on
the machine, and the load generator's busy fraction are recorded per scenario and run.

    .venv/bin/python -m bench.gateway --out out/bench-gateway.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import random
import re
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
import yaml

from probex.processes import free_port

MODEL = "mock-model"
# The gateway's goals: added TTFT p50 sequential, added p99 at 128 concurrent streams.
GOAL_SEQUENTIAL_P50_MS = 0.6
GOAL_CONCURRENT_P99_MS = 3.0



def _wait(url: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=1).status_code < 500:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} did not come up")


_MOCK_NS = re.compile(rb'"mock_ns": ?\{"request": ?(\d+), ?"sent": ?(\d+)\}')


class _Stream(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection of the load generator, carrying one SSE stream at a time.

    It decodes just what the servers send (a head, then a chunked or content-length body) and
    stamps each content event with the time its bytes were handed to this process.
    """

    def __init__(self) -> None:
        self.transport = None
        self.buf = bytearray()
        self.sse = bytearray()
        self.state = "idle"
        self.left = 0
        self.waiter: asyncio.Future | None = None

    def connection_made(self, transport) -> None:
        self.transport = transport
        transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def connection_lost(self, exc) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(ConnectionError(f"server closed the connection mid-stream ({exc})"))

    def request(self, raw: bytes) -> asyncio.Future:
        self.state, self.status, self.stamps, self.mock = "head", 0, [], []
        self.waiter = asyncio.get_running_loop().create_future()
        self.start = time.monotonic()
        self.transport.write(raw)
        return self.waiter

    def data_received(self, data: bytes) -> None:
        now = time.monotonic()
        buf = self.buf
        buf += data
        while True:
            state = self.state
            if state == "head":
                end = buf.find(b"\r\n\r\n")
                if end < 0:
                    return
                lines = bytes(buf[:end]).split(b"\r\n")
                del buf[:end + 4]
                self.status = int(lines[0].split()[1])
                headers = {k.strip().lower(): v.strip() for k, v in (h.split(b":", 1) for h in lines[1:])}
                if headers.get(b"transfer-encoding") == b"chunked":
                    self.state = "size"
                else:
                    self.state, self.left = "body", int(headers.get(b"content-length", b"0"))
            elif state == "size":
                end = buf.find(b"\r\n")
                if end < 0:
                    return
                size = int(bytes(buf[:end]).split(b";")[0], 16)
                if size == 0:
                    if len(buf) < end + 4:  # the last chunk's empty trailer line
                        return
                    del buf[:end + 4]
                    self._finish(now)
                    return
                del buf[:end + 2]
                self.state, self.left = "data", size
            elif state == "data":
                if len(buf) < self.left + 2:
                    return
                self.sse += buf[:self.left]
                del buf[:self.left + 2]
                self.state = "size"
                self._events(now)
            elif state == "body":
                if len(buf) < self.left:
                    return
                self.sse += buf[:self.left]
                del buf[:self.left]
                self._finish(now)
                return
            else:
                return

    def _events(self, now: float) -> None:
        sse = self.sse
        while True:
            end = sse.find(b"\n\n")
            if end < 0:
                return
            event = bytes(sse[:end])
            del sse[:end + 2]
            # The role-only first chunk (`"content": ""`) is not a token, with or without spaces.
            if event.startswith(b"data: {") and b'"content": ""' not in event and b'"content":""' not in event:
                self.stamps.append(now)
                found = _MOCK_NS.search(event)
                if found:
                    self.mock.append((int(found[1]) * 1e-9, int(found[2]) * 1e-9))

    def _finish(self, now: float) -> None:
        self._events(now)
        self.state = "idle"
        self.sse.clear()
        if not self.waiter.done():
            self.waiter.set_result(None)


def _request_bytes(port: int, tokens: int, tokens_per_s: float) -> bytes:
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hello there"}],
                       "max_tokens": tokens, "stream": True, "mock_tokens_per_s": tokens_per_s}).encode()
    return (b"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1:%d\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n" % (port, len(body))) + body


async def _one_stream(conn: _Stream, raw: bytes, tokens: int) -> dict:
    await conn.request(raw)
    if conn.status != 200 or len(conn.stamps) != tokens or len(conn.mock) != tokens:
        raise RuntimeError(f"stream failed: HTTP {conn.status}, {len(conn.stamps)} of {tokens} tokens, "
                           f"{len(conn.mock)} mock timestamps")
    stamps, mock = conn.stamps, conn.mock
    ttft = stamps[0] - conn.start
    mock_first_token_s = mock[0][1] - mock[0][0]  # the mock's own time: request in -> first token out
    return {"ttft": ttft, "transit": ttft - mock_first_token_s, "total": stamps[-1] - conn.start,
            "deliveries": [got - sent for got, (_, sent) in zip(stamps, mock)],
            "gaps": np.diff(stamps).tolist()}


_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _proc_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process (all its threads), from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK


def _machine_busy_s() -> float:
    """CPU seconds all cores spent busy since boot (everything on the machine, not just ours)."""
    values = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = values[3] + (values[4] if len(values) > 4 else 0)
    return (sum(values[:8]) - idle) / _TICK


class _CpuMeter:
    """CPU time of the mock, the gateway, this load generator and the rest of the machine, summed over runs."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = pids
        self.delta: dict[str, float] = {}

    def _read(self) -> dict[str, float]:
        out = {name: _proc_cpu_s(pid) for name, pid in self.pids.items()}
        out["load_generator"] = time.process_time()
        out["machine"] = _machine_busy_s()
        out["wall"] = time.perf_counter()
        return out

    def __enter__(self) -> "_CpuMeter":
        self.start = self._read()
        return self

    def __exit__(self, *exc) -> None:
        end = self._read()
        for k in end:
            self.delta[k] = self.delta.get(k, 0.0) + end[k] - self.start[k]

    def summary(self, streams: int, events_per_stream: int) -> dict:
        d = self.delta
        ours = sum(v for k, v in d.items() if k not in ("machine", "wall"))
        out = {"wall_s": d["wall"], "streams": streams}
        for name in [*self.pids, "load_generator"]:
            out[f"{name}_cpu_ms_per_stream"] = d[name] / streams * 1e3
            out[f"{name}_busy_cores"] = d[name] / d["wall"]  # 1.0: one core flat out
        if "gateway" in self.pids:
            out["gateway_cpu_ms_per_event"] = d["gateway"] / (streams * events_per_stream) * 1e3
        out["busy_cores_ours"] = ours / d["wall"]  # of cpu_count cores
        out["busy_cores_other_processes"] = max(0.0, d["machine"] - ours) / d["wall"]
        return out


class _OverheadMeter:
    """The gateway's own overhead histogram over the timed windows only (not the warm-up streams)."""

    def __init__(self, metrics_url: str) -> None:
        self.url = metrics_url
        self.buckets: list[tuple[float, float]] | None = None
        self.count = self.total = 0.0

    def __enter__(self) -> "_OverheadMeter":
        self.before = httpx.get(self.url).text
        return self

    def __exit__(self, *exc) -> None:
        buckets0, count0, total0 = _parse_overhead(self.before)
        buckets, count, total = _parse_overhead(httpx.get(self.url).text)
        delta = [(le, c - c0) for (le, c), (_, c0) in zip(buckets, buckets0)]
        self.buckets = delta if self.buckets is None else [(le, c + d) for (le, c), (_, d) in zip(self.buckets, delta)]
        self.count += count - count0
        self.total += total - total0

    def summary(self) -> dict:
        return _overhead_summary(self.buckets or [], self.count, self.total)


async def _run(port: int, concurrency: int, per_client: int, tokens: int, tokens_per_s: float, stagger_s: float,
               meter: _CpuMeter, overhead: _OverheadMeter | None, seed: int) -> list[dict]:
    loop = asyncio.get_running_loop()
    conns = [(await loop.create_connection(_Stream, "127.0.0.1", port))[1] for _ in range(concurrency)]
    try:
        # Warm every connection (and, through the gateway, one upstream connection per client).
        warm = _request_bytes(port, 2, 0)
        await asyncio.gather(*(_one_stream(c, warm, 2) for c in conns))
        raw = _request_bytes(port, tokens, tokens_per_s)
        rng = random.Random(seed)
        offsets = [rng.uniform(0, stagger_s) for _ in conns]

        async def client(conn: _Stream, offset: float) -> list[dict]:
            if offset:
                await asyncio.sleep(offset)
            return [await _one_stream(conn, raw, tokens) for _ in range(per_client)]

        # Scraping /metrics blocks this loop for a moment: outside the timed (and CPU-metered) window.
        with (overhead or contextlib.nullcontext()), meter:
            results = await asyncio.gather(*(client(c, o) for c, o in zip(conns, offsets)))
    finally:
        for conn in conns:
            conn.transport.close()
    return [r for rs in results for r in rs]


def _run_sync(*args) -> list[dict]:
    try:
        import uvloop  # lighter per event than the standard loop
    except ImportError:
        return asyncio.run(_run(*args))
    return uvloop.run(_run(*args))


def _summary(samples: list[dict]) -> dict:
    pct = lambda a, q: float(np.percentile(a, q))  # noqa: E731
    arrays = {"ttft": [s["ttft"] for s in samples], "ttft_transit": [s["transit"] for s in samples],
              "chunk_delivery": [d for s in samples for d in s["deliveries"]],
              "chunk_gap": [g for s in samples for g in s["gaps"]], "total": [s["total"] for s in samples]}
    out: dict = {"requests": len(samples)}
    for name, values in arrays.items():
        a = np.array(values) * 1e3
        out[f"{name}_ms_p50"], out[f"{name}_ms_p99"] = pct(a, 50), pct(a, 99)
    return out


def _parse_overhead(text: str) -> tuple[list[tuple[float, float]], float, float]:
    """(cumulative buckets, count, sum) of probex_gateway_overhead_seconds from a /metrics scrape."""
    buckets, count, total = [], 0.0, 0.0
    for line in text.splitlines():
        if line.startswith("probex_gateway_overhead_seconds_bucket"):
            le = line.split('le="')[1].split('"')[0]
            buckets.append((float("inf") if le == "+Inf" else float(le), float(line.rsplit(" ", 1)[1])))
        elif line.startswith("probex_gateway_overhead_seconds_count"):
            count = float(line.rsplit(" ", 1)[1])
        elif line.startswith("probex_gateway_overhead_seconds_sum"):
            total = float(line.rsplit(" ", 1)[1])
    return buckets, count, total


def _overhead_summary(buckets: list[tuple[float, float]], count: float, total: float) -> dict:
    def quantile(q: float) -> float:
        target = q * count
        for le, c in buckets:
            if c >= target:
                return le * 1e3
        return float("inf")

    return {"requests": int(count), "mean_ms": total / count * 1e3 if count else None,
            "p50_ms_upper_bound": quantile(0.5), "p99_ms_upper_bound": quantile(0.99)}


def measure_reload(gateway: str, policy_path: Path, policy: dict, trials: int = 10) -> dict:
    """Seconds from saving an edited policy file to the first response decided under it."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 1}
    timings = []
    with httpx.Client(timeout=10) as client:
        for trial in range(trials):
            blocking = trial % 2 == 0  # alternate: block everything / back to the normal policy
            edited = dict(policy, rules=[{"probe": "harmful-request", "prompt": {"block": 0.01}}]) if blocking else policy
            time.sleep(0.3)
            saved = time.perf_counter()
            policy_path.write_text(yaml.safe_dump(edited))
            while True:
                status = client.post(gateway + "/v1/chat/completions", json=body).status_code
                if (status == 400) == blocking:
                    break
                if time.perf_counter() - saved > 10:
                    raise RuntimeError("policy edit not applied within 10 s")
            timings.append(time.perf_counter() - saved)
    arr = np.array(timings) * 1e3
    return {"trials": trials, "ms_p50": float(np.percentile(arr, 50)), "ms_max": float(arr.max())}


def _scenarios(args) -> list[dict]:
    fast = dict(tokens=args.tokens, tokens_per_s=args.tokens_per_s, stagger_s=0.0)
    return [
        dict(name="sequential", concurrency=1, per_client=args.sequential // args.rounds, rounds=args.rounds, **fast),
        dict(name="light", concurrency=args.light, per_client=args.light_per_client // args.rounds,
             rounds=args.rounds, **fast),
        dict(name="concurrent", concurrency=args.concurrency, per_client=args.per_client, rounds=1,
             tokens=args.concurrent_tokens, tokens_per_s=args.concurrent_tokens_per_s,
             stagger_s=args.concurrent_tokens / args.concurrent_tokens_per_s),
    ]


def run(out: Path, args) -> dict:
    work = Path(tempfile.mkdtemp(prefix="probex-bench-"))
    from probes.artifact import ProbeArtifact, ReadPoint, save_probe

    save_probe(ProbeArtifact(name="harmful-request", layer=3, read=ReadPoint.LAST_PROMPT_TOKEN,
                             weight=np.ones(8, np.float32), bias=0.0), work / "probes" / "harmful-request")
    policy = {"probes": {"harmful-request": {"path": "probes/harmful-request"}},
              "rules": [{"probe": "harmful-request", "prompt": {"flag": 0.5, "block": 0.9},
                         "generated": {"flag": 0.5, "block": 0.99}}],
              "forward_fields": ["mock_tokens_per_s"]}  # the mock worker's pace, harmless to forward
    (work / "policy.yaml").write_text(yaml.safe_dump(policy))
    mock_port, gw_port = free_port(), free_port()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    # The mock on the standard asyncio loop: its sleeps last at least what is asked, while uvloop's
    # timers tick in whole milliseconds, which would make the mock's time to first token depend on
    # where in a millisecond each request landed.
    procs = [
        subprocess.Popen([sys.executable, "-m", "tests.fixtures.mock_upstream", "--port", str(mock_port),
                          "--tokens-per-s", str(args.tokens_per_s), "--timestamps", "--loop", "asyncio"], env=env),
        subprocess.Popen([sys.executable, "-m", "probex.cli", "gateway", "--config", str(work / "policy.yaml"),
                          "--upstream", f"http://127.0.0.1:{mock_port}", "--port", str(gw_port)], env=env,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL),
    ]
    gateway = f"http://127.0.0.1:{gw_port}"
    try:
        _wait(f"http://127.0.0.1:{mock_port}/health")
        _wait(gateway + "/health")
        result: dict = {
            "setup": {"cpu_count": os.cpu_count(), "python": platform.python_version(), "machine": platform.machine(),
                      "load_generator": "asyncio sockets, one keep-alive connection per client, one write per "
                                        "request", "mock_loop": "asyncio"},
        }
        for sc in _scenarios(args):
            events = sc["tokens"] + 2  # role chunk, content chunks, [DONE]
            meters = {"direct": _CpuMeter({"mock": procs[0].pid}),
                      "gateway": _CpuMeter({"mock": procs[0].pid, "gateway": procs[1].pid})}
            samples: dict[str, list[dict]] = {"direct": [], "gateway": []}
            overhead = _OverheadMeter(gateway + "/metrics")
            for r in range(sc["rounds"]):
                for mode in (("direct", "gateway") if r % 2 == 0 else ("gateway", "direct")):
                    port = mock_port if mode == "direct" else gw_port
                    samples[mode] += _run_sync(port, sc["concurrency"], sc["per_client"], sc["tokens"],
                                               sc["tokens_per_s"], sc["stagger_s"], meters[mode],
                                               overhead if mode == "gateway" else None, r)
            d, g = _summary(samples["direct"]), _summary(samples["gateway"])
            added = {k.replace("_ms_", "_added_ms_"): g[k] - d[k] for k in d if k.endswith(("p50", "p99"))}
            streams = sc["concurrency"] * sc["per_client"] * sc["rounds"]
            result[sc["name"]] = {
                "concurrency": sc["concurrency"], "tokens_per_stream": sc["tokens"],
                "tokens_per_s_per_stream": sc["tokens_per_s"],
                "content_events_per_s_offered": sc["concurrency"] * sc["tokens_per_s"],
                "client_start_spread_s": sc["stagger_s"], "rounds": sc["rounds"],
                "direct": d, "gateway": g, "added": added,
                "gateway_self_reported_overhead": overhead.summary(),
                "cpu": {mode: meters[mode].summary(streams, events) for mode in meters}}
        result["reload_save_to_decision"] = measure_reload(gateway, work / "policy.yaml", policy)
    finally:
        for p in procs:
            p.terminate()
            p.wait(10)
    seq, conc = result["sequential"]["added"], result["concurrent"]["added"]
    result["goals"] = {
        "sequential_added_ttft_p50_ms": {"goal": GOAL_SEQUENTIAL_P50_MS, "measured": seq["ttft_added_ms_p50"],
                                         "transit_measured": seq["ttft_transit_added_ms_p50"]},
        "concurrent_added_ttft_p99_ms": {"goal": GOAL_CONCURRENT_P99_MS, "measured": conc["ttft_added_ms_p99"],
                                         "transit_measured": conc["ttft_transit_added_ms_p99"],
                                         "chunk_delivery_measured": conc["chunk_delivery_added_ms_p99"]},
    }
    for goal in result["goals"].values():
        goal["met"] = all(v <= goal["goal"] for k, v in goal.items() if k.endswith("measured"))
    busiest = max(c["busy_cores_other_processes"] for n in ("sequential", "light", "concurrent")
                  for c in result[n]["cpu"].values())
    result["other_processes_max_busy_cores"] = busiest
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("out/bench-gateway.json"))
    parser.add_argument("--tokens", type=int, default=16, help="tokens per stream, sequential and light")
    parser.add_argument("--tokens-per-s", type=float, default=400.0, help="per stream, sequential and light")
    parser.add_argument("--sequential", type=int, default=200, help="streams in the sequential scenario")
    parser.add_argument("--light", type=int, default=4, help="streams in flight in the light scenario")
    parser.add_argument("--light-per-client", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=2, help="direct/gateway alternations (sequential, light)")
    parser.add_argument("--concurrency", type=int, default=128)
    parser.add_argument("--per-client", type=int, default=4, help="streams per client, concurrent scenario")
    parser.add_argument("--concurrent-tokens", type=int, default=64)
    parser.add_argument("--concurrent-tokens-per-s", type=float, default=20.0, help="per stream")
    args = parser.parse_args()
    result = run(args.out, args)
    print(f"{'scenario':11} {'metric':15} {'direct p50':>10} {'gw p50':>8} {'added p50':>9} {'direct p99':>10} "
          f"{'gw p99':>8} {'added p99':>9}  (ms)")
    names = ("sequential", "light", "concurrent")
    for name in names:
        r = result[name]
        for metric in ("ttft", "ttft_transit", "chunk_delivery", "chunk_gap", "total"):
            d, g = r["direct"], r["gateway"]
            print(f"{name:11} {metric:15} {d[metric + '_ms_p50']:10.3f} {g[metric + '_ms_p50']:8.3f} "
                  f"{g[metric + '_ms_p50'] - d[metric + '_ms_p50']:9.3f} {d[metric + '_ms_p99']:10.3f} "
                  f"{g[metric + '_ms_p99']:8.3f} {g[metric + '_ms_p99'] - d[metric + '_ms_p99']:9.3f}")
    print("CPU per stream (ms): mock / gateway / load generator; busy cores ours + other processes "
          f"(of {result['setup']['cpu_count']})")
    for name in names:
        for run_name, c in result[name]["cpu"].items():
            gw = f"{c['gateway_cpu_ms_per_stream']:6.2f}" if "gateway_cpu_ms_per_stream" in c else "     -"
            print(f"{name:11} {run_name:8} {c['mock_cpu_ms_per_stream']:6.2f} / {gw} / "
                  f"{c['load_generator_cpu_ms_per_stream']:6.2f}   busy {c['busy_cores_ours']:.2f} + "
                  f"{c['busy_cores_other_processes']:.2f} over {c['wall_s']:.1f} s "
                  f"(load generator alone {c['load_generator_busy_cores']:.2f})")
    print("gateway's own overhead per stream (probex_gateway_overhead_seconds, upstream waits excluded): " + ", ".join(
        f"{n} mean {result[n]['gateway_self_reported_overhead']['mean_ms']:.2f} ms" for n in names))
    reload = result["reload_save_to_decision"]
    print(f"policy file save -> first decision under it: p50 {reload['ms_p50']:.0f} ms, max {reload['ms_max']:.0f} ms"
          f" ({reload['trials']} edits)")
    for key, goal in result["goals"].items():
        measured = ", ".join(f"{k} {v:.3f}" for k, v in goal.items() if k.endswith("measured"))
        print(f"goal {key} <= {goal['goal']}: {measured} -> {'met' if goal['met'] else 'NOT met'}")
    if result["other_processes_max_busy_cores"] > 0.1:
        print(f"WARNING: other processes used up to {result['other_processes_max_busy_cores']:.2f} cores during a "
              "run; rerun on an idle machine before trusting these numbers")
    print(f"JSON: {args.out}")


if __name__ == "__main__":
    main()
