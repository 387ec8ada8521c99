"""Gateway overhead benchmark: the same streams sent directly to a mock worker and through the gateway.

Three processes on this machine: the in-repo mock worker (`gateway.mock_upstream`, streaming
at a fixed token rate), the gateway (`probex gateway`, with a policy that judges every
chunk), and this load generator. Scenarios:

- sequential: one stream at a time;
- light: 4 streams in flight at once (below what a 2-core machine can serve);
- concurrent: 128 streams in flight at once (far above it: the single-threaded load
  generator runs flat out and the streams queue for CPU).

For each request we record time to first content chunk (TTFT), total time and the gaps
between chunks, once direct and once through the gateway; "added" is the gateway
percentile minus the direct one. The gateway's own measurement of time spent inside it
(`probex_gateway_overhead_seconds`, upstream waits excluded) is read from /metrics too.
Last, the policy file is edited 10 times (alternating a block-everything rule and the normal
policy) and the time from save to the first response decided under the new version is
recorded. CPU time of each process (and of everything else on the machine) is recorded per
scenario, to tell the gateway's cost from contention.

    .venv/bin/python -m probex.bench_gateway --out out/bench-gateway.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
import yaml

MODEL = "mock-model"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


def _has_content(line: str) -> bool:
    """Not the role-only first chunk (`"content": ""`), whether or not the JSON has spaces after colons."""
    return '"content": ""' not in line and '"content":""' not in line


async def _one_stream(client: httpx.AsyncClient, url: str, tokens: int) -> dict:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hello there"}], "max_tokens": tokens,
            "stream": True}
    start = time.perf_counter()
    stamps = []
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: {") and _has_content(line):
                stamps.append(time.perf_counter())
    return {"ttft": stamps[0] - start, "total": stamps[-1] - start, "gaps": np.diff(stamps).tolist(),
            "chunks": len(stamps)}


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
    """CPU time of the mock, the gateway, this load generator and the rest of the machine over a run."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = pids

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
        self.delta = {k: end[k] - self.start[k] for k in end}

    def summary(self, streams: int, chunks_per_stream: int) -> dict:
        d = self.delta
        ours = sum(v for k, v in d.items() if k not in ("machine", "wall"))
        out = {"wall_s": d["wall"], "streams": streams}
        for name in [*self.pids, "load_generator"]:
            out[f"{name}_cpu_ms_per_stream"] = d[name] / streams * 1e3
            out[f"{name}_busy_cores"] = d[name] / d["wall"]  # 1.0: one core flat out (the load generator's limit)
        if "gateway" in self.pids:
            out["gateway_cpu_ms_per_chunk"] = d["gateway"] / (streams * chunks_per_stream) * 1e3
        out["busy_cores_ours"] = ours / d["wall"]  # of cpu_count cores
        out["busy_cores_other_processes"] = max(0.0, d["machine"] - ours) / d["wall"]
        return out


async def _scenario(url: str, concurrency: int, requests_per_client: int, tokens: int,
                    meter: _CpuMeter | None = None) -> list[dict]:
    limits = httpx.Limits(max_connections=concurrency + 8, max_keepalive_connections=concurrency + 8)
    async with httpx.AsyncClient(timeout=60, limits=limits) as client:
        await _one_stream(client, url, tokens)  # warm the connection pool and both servers

        async def worker() -> list[dict]:
            return [await _one_stream(client, url, tokens) for _ in range(requests_per_client)]

        if meter is None:
            results = await asyncio.gather(*(worker() for _ in range(concurrency)))
        else:
            with meter:
                results = await asyncio.gather(*(worker() for _ in range(concurrency)))
    return [r for rs in results for r in rs]


def _summary(samples: list[dict]) -> dict:
    ttft = np.array([s["ttft"] for s in samples]) * 1e3
    total = np.array([s["total"] for s in samples]) * 1e3
    gaps = np.array([g for s in samples for g in s["gaps"]]) * 1e3
    pct = lambda a, q: float(np.percentile(a, q))  # noqa: E731
    return {"requests": len(samples), "ttft_ms_p50": pct(ttft, 50), "ttft_ms_p99": pct(ttft, 99),
            "total_ms_p50": pct(total, 50), "total_ms_p99": pct(total, 99),
            "chunk_gap_ms_p50": pct(gaps, 50), "chunk_gap_ms_p99": pct(gaps, 99)}


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


def _overhead_from_metrics(text: str, before: str | None = None) -> dict:
    """The gateway's overhead histogram: requests since `before` (an earlier scrape) when given."""
    buckets, count, total = _parse_overhead(text)
    if before is not None:
        buckets0, count0, total0 = _parse_overhead(before)
        buckets = [(le, c - c0) for (le, c), (_, c0) in zip(buckets, buckets0)]
        count, total = count - count0, total - total0
    return _overhead_summary(buckets, count, total)


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


def run(out: Path, tokens: int, tokens_per_s: float, sequential: int, concurrency: int, per_client: int,
        light: int = 4, light_per_client: int = 50) -> dict:
    work = Path(tempfile.mkdtemp(prefix="probex-bench-"))
    from probes.artifact import ProbeArtifact, ReadPoint, save_probe

    save_probe(ProbeArtifact(name="harmful-request", layer=3, read=ReadPoint.LAST_PROMPT_TOKEN,
                             weight=np.ones(8, np.float32), bias=0.0), work / "probes" / "harmful-request")
    policy = {"probes": {"harmful-request": {"path": "probes/harmful-request"}},
              "rules": [{"probe": "harmful-request", "prompt": {"flag": 0.5, "block": 0.9},
                         "generated": {"flag": 0.5, "block": 0.99}}]}
    (work / "policy.yaml").write_text(yaml.safe_dump(policy))
    mock_port, gw_port = _free_port(), _free_port()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    procs = [
        subprocess.Popen([sys.executable, "-m", "gateway.mock_upstream", "--port", str(mock_port),
                          "--tokens-per-s", str(tokens_per_s)], env=env),
        subprocess.Popen([sys.executable, "-m", "probex.cli", "gateway", "--config", str(work / "policy.yaml"),
                          "--upstream", f"http://127.0.0.1:{mock_port}", "--port", str(gw_port)], env=env,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL),
    ]
    direct, gateway = f"http://127.0.0.1:{mock_port}", f"http://127.0.0.1:{gw_port}"
    try:
        _wait(direct + "/health")
        _wait(gateway + "/health")
        result: dict = {
            "setup": {"tokens_per_stream": tokens, "mock_tokens_per_s": tokens_per_s, "cpu_count": os.cpu_count(),
                      "python": platform.python_version(), "machine": platform.machine()},
        }
        chunks = tokens + 2  # role chunk, content chunks, [DONE]
        scenarios = (("sequential", 1, sequential), ("light", light, light_per_client),
                     ("concurrent", concurrency, per_client))
        for name, conc, per in scenarios:
            d_meter = _CpuMeter({"mock": procs[0].pid})
            g_meter = _CpuMeter({"mock": procs[0].pid, "gateway": procs[1].pid})
            d = _summary(asyncio.run(_scenario(direct, conc, per, tokens, d_meter)))
            before = httpx.get(gateway + "/metrics").text
            g = _summary(asyncio.run(_scenario(gateway, conc, per, tokens, g_meter)))
            after = httpx.get(gateway + "/metrics").text
            added = {k.replace("_ms_", "_added_ms_"): g[k] - d[k] for k in d if k.endswith(("p50", "p99"))}
            result[name] = {"concurrency": conc, "direct": d, "gateway": g, "added": added,
                            "gateway_self_reported_overhead": _overhead_from_metrics(after, before),
                            "cpu": {"direct": d_meter.summary(conc * per, chunks),
                                    "gateway": g_meter.summary(conc * per, chunks)}}
        result["reload_save_to_decision"] = measure_reload(gateway, work / "policy.yaml", policy)
    finally:
        for p in procs:
            p.terminate()
            p.wait(10)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("out/bench-gateway.json"))
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--tokens-per-s", type=float, default=400.0)
    parser.add_argument("--sequential", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=128)
    parser.add_argument("--per-client", type=int, default=3)
    parser.add_argument("--light", type=int, default=4, help="streams in flight in the light scenario")
    parser.add_argument("--light-per-client", type=int, default=50)
    args = parser.parse_args()
    result = run(args.out, args.tokens, args.tokens_per_s, args.sequential, args.concurrency, args.per_client,
                 args.light, args.light_per_client)
    print(f"{'scenario':12} {'metric':10} {'direct p50':>10} {'gw p50':>8} {'added p50':>9} {'direct p99':>10} "
          f"{'gw p99':>8} {'added p99':>9}  (ms)")
    names = [n for n in ("sequential", "light", "concurrent") if n in result]
    for name in names:
        r = result[name]
        for metric in ("ttft", "chunk_gap", "total"):
            d, g = r["direct"], r["gateway"]
            print(f"{name:12} {metric:10} {d[metric + '_ms_p50']:10.3f} {g[metric + '_ms_p50']:8.3f} "
                  f"{g[metric + '_ms_p50'] - d[metric + '_ms_p50']:9.3f} {d[metric + '_ms_p99']:10.3f} "
                  f"{g[metric + '_ms_p99']:8.3f} {g[metric + '_ms_p99'] - d[metric + '_ms_p99']:9.3f}")
    print("CPU per stream (ms): mock / gateway / load generator; busy cores ours + other processes "
          f"(of {result['setup']['cpu_count']})")
    for name in names:
        for run_name, c in result[name]["cpu"].items():
            gw = f"{c['gateway_cpu_ms_per_stream']:6.2f}" if "gateway_cpu_ms_per_stream" in c else "     -"
            print(f"{name:12} {run_name:8} {c['mock_cpu_ms_per_stream']:6.2f} / {gw} / "
                  f"{c['load_generator_cpu_ms_per_stream']:6.2f}   busy {c['busy_cores_ours']:.2f} + "
                  f"{c['busy_cores_other_processes']:.2f} over {c['wall_s']:.1f} s "
                  f"(load generator alone {c['load_generator_busy_cores']:.2f})")
    print("gateway's own overhead per stream (probex_gateway_overhead_seconds, upstream waits excluded): " + ", ".join(
        f"{n} mean {result[n]['gateway_self_reported_overhead']['mean_ms']:.2f} ms" for n in names))
    reload = result["reload_save_to_decision"]
    print(f"policy file save -> first decision under it: p50 {reload['ms_p50']:.0f} ms, max {reload['ms_max']:.0f} ms"
          f" ({reload['trials']} edits)")
    print(f"JSON: {args.out}")


if __name__ == "__main__":
    main()
