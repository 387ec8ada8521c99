"""docker/docker-compose.yml, statically: what `docker compose up` needs to line up before anything is built.

Images are not built here (no registry access on the test machines); this checks that every
build context and Dockerfile exists, that service names and ports agree with the Prometheus
scrape config, the gateway's --upstream / --redis and the Grafana provisioning, that mounted
host paths exist, and that gateway and worker see config/ at the same path (the gateway pushes
probe sets to the worker as directory paths).
"""

from __future__ import annotations

import json
import re
from pathlib import Path, PurePosixPath
from urllib.parse import urlsplit

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
DOCKER = REPO / "docker"
COMPOSE = DOCKER / "docker-compose.yml"
GPU_OVERRIDE = DOCKER / "docker-compose.gpu.yml"
SCRAPE_CONFIG = REPO / "dashboards" / "prometheus.yml"
GRAFANA = DOCKER / "grafana" / "provisioning"


def load(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


@pytest.fixture(scope="module")
def services() -> dict:
    return load(COMPOSE)["services"]


def flag(command: list[str], name: str) -> str:
    """The value of `--name VALUE` or `--name=VALUE` in a command list."""
    for i, arg in enumerate(command):
        if arg == name:
            return command[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    raise AssertionError(f"{name} not in {command}")


def listens_on(service: dict) -> set[int]:
    return {int(str(p).split("/")[0]) for p in service.get("expose", [])}


def bind_mounts(service: dict) -> list[tuple[Path, PurePosixPath]]:
    """(host path, container path) of the service's bind mounts (named volumes left out)."""
    out = []
    for spec in service.get("volumes", []):
        source, target = spec.split(":")[:2]
        if source.startswith((".", "/")):
            out.append(((COMPOSE.parent / source).resolve(), PurePosixPath(target)))
    return out


def host_path(service: dict, container_path: str) -> Path:
    """Where a container path of a service comes from on the host, through its bind mounts."""
    path = PurePosixPath(container_path)
    for source, target in bind_mounts(service):
        if path == target or target in path.parents:
            return source / path.relative_to(target)
    raise AssertionError(f"{container_path} is not under any bind mount of the service")


@pytest.mark.parametrize("compose_file", [COMPOSE, GPU_OVERRIDE], ids=lambda p: p.name)
def test_build_contexts_and_dockerfiles_exist(compose_file):
    built = 0
    for name, service in load(compose_file)["services"].items():
        build = service.get("build")
        if build is None:
            assert "image" in service, f"{name}: neither build nor image"
            continue
        context = (compose_file.parent / build["context"]).resolve()
        dockerfile = context / build["dockerfile"]
        assert context == REPO, f"{name}: the Dockerfiles copy the repository, so the context is its root"
        assert dockerfile.is_file(), f"{name}: {dockerfile} missing"
        # Everything the Dockerfile copies from the context exists and is not excluded by its ignore file.
        ignore = dockerfile.with_name(dockerfile.name + ".dockerignore").read_text().split()
        allowed = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
        for line in dockerfile.read_text().splitlines():
            if line.startswith("COPY ") and "--from" not in line:
                for src in line.split()[1:-1]:
                    assert (context / src).exists(), f"{dockerfile.name}: COPY {src}: not in the repository"
                    assert src.rstrip("/") in allowed, f"{dockerfile.name}: COPY {src} is excluded by its .dockerignore"
        built += 1
    assert built, compose_file


def test_the_gpu_override_only_swaps_the_worker_image(services):
    override = load(GPU_OVERRIDE)["services"]
    assert set(override) == {"worker"} and set(override["worker"]) <= {"build", "deploy"}
    assert override["worker"]["build"]["dockerfile"] == "docker/Dockerfile.worker"
    assert services["worker"]["build"]["dockerfile"] == "docker/Dockerfile.worker-cpu"


def test_dockerfiles_listen_where_compose_says(services):
    for name in ("gateway", "worker"):
        dockerfile = REPO / services[name]["build"]["dockerfile"]
        exposed = {int(p) for p in re.findall(r"^EXPOSE (\d+)", dockerfile.read_text(), re.M)}
        assert exposed == listens_on(services[name]) == {int(flag(services[name]["command"], "--port"))}, name
        assert flag(services[name]["command"], "--host") == "0.0.0.0", f"{name} must listen beyond the container"
        entry = re.search(r"^ENTRYPOINT (.+)$", dockerfile.read_text(), re.M).group(1)
        assert json.loads(entry) == ["probex", name]
    gpu = (REPO / "docker" / "Dockerfile.worker").read_text()
    assert 'ENTRYPOINT ["probex", "worker"]' in gpu and "EXPOSE 8100" in gpu


def test_prometheus_scrapes_the_compose_services_on_their_ports(services):
    jobs = {job["job_name"]: job for job in load(SCRAPE_CONFIG)["scrape_configs"]}
    seen = set()
    for job in jobs.values():
        for target in (t for sc in job["static_configs"] for t in sc["targets"]):
            host, port = target.rsplit(":", 1)
            if host == "localhost":  # Prometheus scraping itself
                assert int(port) in listens_on(services["prometheus"])
                continue
            assert host in services, f"scrape target {target}: no service {host!r}"
            assert int(port) in listens_on(services[host]), f"scrape target {target}: {host} does not listen there"
            seen.add(host)
    assert seen == {"gateway", "worker"}
    assert flag(services["prometheus"]["command"], "--web.listen-address").endswith(":9090")


def test_gateway_upstream_and_redis_point_at_the_services(services):
    command = services["gateway"]["command"]
    upstream = urlsplit(flag(command, "--upstream"))
    assert upstream.hostname == "worker" and upstream.port in listens_on(services["worker"])
    assert upstream.port == int(flag(services["worker"]["command"], "--port"))
    redis = urlsplit(flag(command, "--redis"))
    assert redis.hostname == "redis" and redis.port in listens_on(services["redis"])
    assert str(redis.port) == flag(services["redis"]["command"], "--port")
    depends = services["gateway"]["depends_on"]
    assert {"worker", "redis"} <= set(depends)
    for name, service in services.items():
        for dep in service.get("depends_on", []):
            assert dep in services, f"{name} depends on unknown service {dep}"


def test_mounted_paths_exist(services):
    for name, service in services.items():
        for source, _ in bind_mounts(service):
            assert source.exists(), f"{name}: mounted {source} does not exist"
    named = set(load(COMPOSE).get("volumes") or {})
    for name, service in services.items():
        for spec in service.get("volumes", []):
            source = spec.split(":")[0]
            if not source.startswith((".", "/")):
                assert source in named, f"{name}: volume {source} not declared"


def test_policy_and_probes_are_the_hosts_and_shared_by_gateway_and_worker(services):
    gateway, worker = services["gateway"], services["worker"]
    policy = flag(gateway["command"], "--config")
    assert host_path(gateway, policy) == REPO / "config" / "policy.yaml"
    # The policy's probe paths resolve next to the policy file; the gateway sends the worker those
    # very paths, so they must mean the same files in both containers.
    policy_dir = PurePosixPath(policy).parent
    for name, ref in load(REPO / "config" / "policy.yaml")["probes"].items():
        in_container = str(policy_dir / ref["path"])
        assert host_path(gateway, in_container) == host_path(worker, in_container) == (REPO / "config" / ref["path"])
        assert (REPO / "config" / ref["path"] / "probe.yaml").is_file(), name
    for probe in [flag(worker["command"], "--probe")]:
        assert (host_path(worker, probe) / "probe.yaml").is_file(), probe
    # A mounted directory, not the policy file: editors replace the file, and the gateway watches the directory.
    assert all(source.is_dir() for source, target in bind_mounts(gateway) if "config" in target.parts)
    token = gateway["environment"]["PROBEX_ADMIN_TOKEN"]
    assert token and token == worker["environment"]["PROBEX_ADMIN_TOKEN"], "the worker must accept the gateway's pushes"


def test_prometheus_gets_the_repos_config_and_rules(services):
    prometheus = services["prometheus"]
    config = flag(prometheus["command"], "--config.file")
    assert host_path(prometheus, config) == SCRAPE_CONFIG
    for rule_file in load(SCRAPE_CONFIG)["rule_files"]:
        in_container = PurePosixPath(config).parent / rule_file
        assert host_path(prometheus, str(in_container)) == REPO / "dashboards" / rule_file


def test_grafana_provisioning_matches_prometheus_and_the_dashboards(services):
    grafana = services["grafana"]
    assert host_path(grafana, "/etc/grafana/provisioning") == GRAFANA
    datasources = load(GRAFANA / "datasources" / "prometheus.yml")["datasources"]
    assert len(datasources) == 1
    source = datasources[0]
    url = urlsplit(source["url"])
    assert source["type"] == "prometheus" and url.hostname == "prometheus"
    assert url.port in listens_on(services["prometheus"])
    scrape_interval = load(SCRAPE_CONFIG)["global"]["scrape_interval"]
    assert source["jsonData"]["timeInterval"] == scrape_interval
    providers = load(GRAFANA / "dashboards" / "probex.yml")["providers"]
    for provider in providers:
        folder = host_path(grafana, provider["options"]["path"])
        boards = sorted(folder.glob("*.json"))
        assert folder == REPO / "dashboards" and boards
        for board in boards:  # every datasource reference in every dashboard is the provisioned one
            refs = re.findall(r'"datasource":\s*\{[^}]*"uid":\s*"([^"]+)"', board.read_text())
            assert refs and set(refs) - {"-- Grafana --"} == {source["uid"]}, board.name
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert host_path(grafana, home).is_file()


def test_host_ports_are_distinct(services):
    published = [str(p).rsplit(":", 2)[-2] for s in services.values() for p in s.get("ports", [])]
    assert len(published) == len(set(published)), published


SECRET_NAMES = re.compile(r"TOKEN|KEY|PASSWORD|SECRET", re.I)


def test_no_fixed_secrets_anywhere_in_compose(services):
    """Every secret is a required variable (`${VAR:?message}`): no default token, no admin/admin."""
    text = "\n".join(path.read_text() for path in (COMPOSE, GPU_OVERRIDE))
    defaults = re.findall(r"\$\{(\w+):?-[^}]*\}", text)
    assert not [name for name in defaults if SECRET_NAMES.search(name)], defaults
    assert "probex-compose-admin" not in text
    for name, service in services.items():
        environment = service.get("environment") or {}
        for variable, value in environment.items():
            if SECRET_NAMES.search(variable):
                assert re.fullmatch(r"\$\{\w+:\?[^}]+\}", str(value)), f"{name}: {variable}={value!r} is fixed"
    for name in ("gateway", "worker"):
        assert "PROBEX_ADMIN_TOKEN" in services[name]["environment"]
    assert "PROBEX_ADMIN_KEYS" in services["gateway"]["environment"]  # it listens on 0.0.0.0
    grafana = services["grafana"]["environment"]
    assert "GF_SECURITY_ADMIN_PASSWORD" in grafana and grafana.get("GF_SECURITY_ADMIN_USER", "admin") == "admin"
    assert "GF_AUTH_ANONYMOUS_ORG_ROLE" not in grafana or grafana["GF_AUTH_ANONYMOUS_ORG_ROLE"] == "Viewer"


def test_prometheus_is_not_published_with_its_admin_apis(services):
    prometheus = services["prometheus"]
    assert not any(arg.startswith(("--web.enable-lifecycle", "--web.enable-admin-api"))
                   for arg in prometheus["command"])
    assert all(str(port).startswith("127.0.0.1:") for port in prometheus.get("ports", []))
