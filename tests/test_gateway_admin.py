"""Closed by default: admin keys from the environment or a secret file, refusing to listen beyond loopback
without one, constant-time comparison, admin actions in the audit log."""

from __future__ import annotations

import json

import httpx
import pytest
import yaml

from gateway.app import GatewayConfig, create_app
from gateway.auth import AdminKeyError, Authenticator, load_admin_keys
from gateway.policy import parse_policy
from probex.cli import main
from tests.gateway_fixtures import base_policy, start_stack, write_probe


def config_for(tmp_path, policy: dict | None = None, **settings) -> GatewayConfig:
    write_probe(tmp_path / "probes", "harmful-request")
    (tmp_path / "policy.yaml").write_text(yaml.safe_dump(policy or base_policy()))
    return GatewayConfig(policy_path=tmp_path / "policy.yaml", upstreams=["http://127.0.0.1:1"],
                         audit_path=tmp_path / "audit.jsonl", **settings)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3", "gateway.example"])
def test_a_gateway_beyond_loopback_without_admin_keys_refuses_to_start(tmp_path, host):
    with pytest.raises(AdminKeyError, match="PROBEX_ADMIN_KEYS=name:key"):
        create_app(config_for(tmp_path, listen_host=host))
    create_app(config_for(tmp_path, listen_host=host, admin_keys={"ops": "k-ops"}))
    create_app(config_for(tmp_path, base_policy(admin_keys={"ops": "k-ops"}), listen_host=host))
    for loopback in ("127.0.0.1", "::1", "localhost"):
        create_app(config_for(tmp_path, listen_host=loopback))


def test_the_gateway_command_says_in_one_line_how_to_add_keys(tmp_path, monkeypatch):
    config = config_for(tmp_path)
    monkeypatch.delenv("PROBEX_ADMIN_KEYS", raising=False)
    monkeypatch.delenv("PROBEX_ADMIN_KEYS_FILE", raising=False)
    argv = ["gateway", "--config", str(config.policy_path), "--upstream", "http://127.0.0.1:1", "--host", "0.0.0.0"]
    with pytest.raises(SystemExit) as info:
        main(argv)
    message = info.value.code
    assert isinstance(message, str) and "\n" not in message and message.startswith("probex gateway: ")
    assert "0.0.0.0" in message and "PROBEX_ADMIN_KEYS" in message and "--admin-key-file" in message
    with pytest.raises(SystemExit) as info:
        main([*argv, "--admin-key-file", str(tmp_path / "missing")])
    assert "cannot read admin key file" in info.value.code


def test_admin_keys_from_the_environment_and_a_secret_file(tmp_path):
    secret = tmp_path / "admin-keys"
    secret.write_text("# operators\nops: k-ops\n\nci:k-ci\nk-bare\n")
    keys = load_admin_keys(None, {"PROBEX_ADMIN_KEYS": "alice:k-alice, bob:k-bob", "PROBEX_ADMIN_KEYS_FILE": str(secret)})
    assert keys == {"alice": "k-alice", "bob": "k-bob", "ops": "k-ops", "ci": "k-ci", f"{secret}#5": "k-bare"}
    assert load_admin_keys(secret, {}) == {"ops": "k-ops", "ci": "k-ci", f"{secret}#5": "k-bare"}
    assert load_admin_keys(None, {}) == {}
    for bad, match in (("ops:\n", "empty name or key"), ("ops:a\nops:b\n", "appears twice")):
        secret.write_text(bad)
        with pytest.raises(AdminKeyError, match=match):
            load_admin_keys(secret, {})
    secret.write_text("alice:k2\n")
    with pytest.raises(AdminKeyError, match="given twice"):
        load_admin_keys(secret, {"PROBEX_ADMIN_KEYS": "alice:k1"})


def test_admin_routes_need_a_key_and_admin_actions_are_audited_by_key_name(tmp_path):
    s = start_stack(tmp_path, base_policy(api_keys={"k-user": "default"}), admin_keys={"ops": "k-ops-secret"})
    try:
        for headers in ({}, {"Authorization": "Bearer k-user"}, {"Authorization": "Bearer k-ops-secre"}):
            for method, path in (("POST", "/admin/reload"), ("GET", "/admin/policy")):
                r = httpx.request(method, s.url + path, headers=headers, timeout=10)
                assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error", (headers, r.text)
        r = httpx.post(s.url + "/admin/reload", headers={"Authorization": "Bearer k-ops-secret"}, timeout=10)
        assert r.status_code == 200, r.text
        s.policy_path.write_text("rules: [broken")
        r = httpx.post(s.url + "/admin/reload", headers={"Authorization": "Bearer k-ops-secret"}, timeout=10)
        assert r.status_code == 400
        audit = (tmp_path / "audit.jsonl").read_text()
        events = [json.loads(line) for line in audit.splitlines()]
        admin = [e for e in events if e.get("event") == "admin"]
        assert [(e["action"], e["actor"], e["result"]) for e in admin] == [("reload", "ops", "ok"),
                                                                          ("reload", "ops", "rejected")]
        assert "k-ops-secret" not in audit
    finally:
        s.stop()


def test_an_open_loopback_gateway_audits_its_local_operator(stack_without_keys):
    s = stack_without_keys
    assert httpx.post(s.url + "/admin/reload", timeout=10).status_code == 200
    event = json.loads((s.policy_path.parent / "audit.jsonl").read_text().splitlines()[-1])
    assert event["event"] == "admin" and event["actor"].startswith("local")


@pytest.fixture
def stack_without_keys(tmp_path):
    s = start_stack(tmp_path)
    yield s
    s.stop()


def test_keys_are_compared_in_constant_time_against_every_key(monkeypatch):
    import hmac

    import gateway.auth

    compared = []
    real = hmac.compare_digest

    def counting(a, b):
        compared.append(b)
        return real(a, b)

    monkeypatch.setattr(gateway.auth.hmac, "compare_digest", counting)
    policy = parse_policy(yaml.safe_dump({"api_keys": {"k-a": "default", "k-b": "default"},
                                          "admin_keys": {"p": "k-policy-admin"}}))
    auth = Authenticator({"ops": "k-ops"}, "127.0.0.1")
    assert auth.identify("k-ops", policy).key_name == "ops"
    assert len(compared) == 2  # both admin keys, though the first matched
    compared.clear()
    caller = auth.identify("k-a", policy)
    assert (caller.tenant, caller.is_admin) == ("default", False) and len(compared) == 4
    assert auth.identify("k-policy-admin", policy).key_name == "policy:p"
