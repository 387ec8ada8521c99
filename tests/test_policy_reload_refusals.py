"""Policy files and probe artifacts a reload must refuse (or notice), and a watcher that outlives them."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import yaml
from safetensors.numpy import save_file

import gateway.policy_manager as policy_manager_module
from gateway.config import GatewayConfig
from gateway.policy_manager import PolicyManager
from gateway.metrics import GatewayMetrics
from tests.fixtures.mock_upstream import MODEL
from gateway.policy import PolicyError, load_policy, parse_policy
from probes.artifact import WEIGHTS_FILE
from tests.gateway_fixtures import base_policy, start_stack

# Each writes a policy file that the YAML reader, the decoder or pathlib used to crash on.
BAD_FILES = {
    "not-utf8": (lambda p: p.write_bytes(yaml.safe_dump(base_policy()).encode() + b'refusal_message: "\xff"\n'),
                 "not UTF-8"),
    "deeply-nested": (lambda p: p.write_text("a: " + "[" * 5000 + "]" * 5000), "nested too deeply"),
    "nul-in-probe-path": (lambda p: p.write_text('probes: {p: {path: "pro\\0bes/p"}}\n'), "NUL character"),
}

# What an editor's truncated save, or a file emptied by mistake, can look like.
EMPTY_DOCUMENTS = ["", "\n\n", "# every line commented out\n# rules: []\n", "null\n", "~\n", "---\n"]


@pytest.fixture
def stack(tmp_path):
    s = start_stack(tmp_path)
    yield s
    s.stop()


def admin_policy(stack) -> dict:
    return httpx.get(stack.url + "/admin/policy", timeout=10).json()


def reload(stack) -> httpx.Response:
    return httpx.post(stack.url + "/admin/reload", timeout=30)


def reload_errors(stack) -> float:
    found = re.search(r'^probex_policy_reloads_total\{result="error"\} (\S+)$',
                      httpx.get(stack.url + "/metrics", timeout=10).text, re.M)
    return float(found.group(1)) if found else 0.0


def blocked(stack) -> bool:
    r = httpx.post(stack.url + "/v1/chat/completions", timeout=10,
                   json={"model": MODEL, "messages": [{"role": "user", "content": "how to build a bomb"}],
                         "max_tokens": 4})
    return r.status_code == 400 and r.json()["error"]["code"] == "content_filter"


def reload_after_edit(stack, earlier_versions: set) -> str:
    """An explicit reload after an edit: the new version is active, whether this reload made it
    so or the file watcher, which also saw the edit, got there first (then this one finds it
    unchanged: on a busy machine it sometimes does)."""
    r = reload(stack)
    assert r.status_code == 200 and ("active" in r.json()["message"] or "unchanged" in r.json()["message"]), r.text
    version = admin_policy(stack)["policy_version"]
    assert version not in earlier_versions, "the edit was not taken up"
    return version


def wait_for_version_change(stack, old: str, timeout_s: float = 10) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        version = admin_policy(stack)["policy_version"]
        if version != old:
            return version
        time.sleep(0.05)
    pytest.fail("the file watcher never picked up a valid edit")


def assert_refused(stack, response: httpx.Response, version: str, fragment: str) -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "policy_rejected" and fragment in error["message"]
    state = admin_policy(stack)
    assert state["policy_version"] == version and fragment in state["last_reload_error"]


@pytest.mark.parametrize("bad", BAD_FILES)
def test_unparseable_policy_files_raise_policy_error(tmp_path, bad):
    write, fragment = BAD_FILES[bad]
    path = tmp_path / "policy.yaml"
    write(path)
    with pytest.raises(PolicyError, match=fragment):
        load_policy(path)


@pytest.mark.parametrize("bad", BAD_FILES)
def test_unparseable_policy_is_refused_and_live_reload_keeps_working(stack, bad):
    write, fragment = BAD_FILES[bad]
    version = admin_policy(stack)["policy_version"]
    errors_before = reload_errors(stack)
    write(stack.policy_path)
    assert_refused(stack, reload(stack), version, fragment)
    assert reload_errors(stack) > errors_before
    assert blocked(stack)
    # The watcher saw the bad file too; it must still be there for the next good save.
    stack.write_policy(base_policy(rules=[]))
    wait_for_version_change(stack, version)
    assert not blocked(stack) and admin_policy(stack)["last_reload_error"] is None


@pytest.mark.parametrize("bad", [*BAD_FILES, "empty"])
def test_gateway_command_refuses_a_bad_policy_without_a_traceback(tmp_path, bad):
    path = tmp_path / "policy.yaml"
    if bad == "empty":
        path.write_text("")
        fragment = "policy file is empty"
    else:
        write, fragment = BAD_FILES[bad]
        write(path)
    done = subprocess.run([sys.executable, "-m", "probex.cli", "gateway", "--config", str(path),
                           "--upstream", "http://127.0.0.1:9"], capture_output=True, text=True, timeout=60,
                          cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr and "probex gateway:" in done.stderr and fragment in done.stderr


@pytest.mark.parametrize("text", EMPTY_DOCUMENTS)
def test_an_empty_policy_document_is_refused(text):
    with pytest.raises(PolicyError, match=r"policy file is empty.*\{\}"):
        parse_policy(text)


def test_an_explicit_empty_mapping_is_still_a_valid_policy():
    loaded = parse_policy(yaml.safe_dump({}))
    assert loaded.probes == {} and loaded.policy.rules == []


def test_an_emptied_policy_file_keeps_enforcing_the_old_policy(stack):
    version = admin_policy(stack)["policy_version"]
    assert blocked(stack)
    stack.state.probes = ["sentinel"]  # any PUT to the worker replaces this
    for text in EMPTY_DOCUMENTS:
        stack.policy_path.write_text(text)
        assert_refused(stack, reload(stack), version, "policy file is empty")
    assert stack.state.probes == ["sentinel"]
    stack.state.probes = ["harmful-request"]  # the mock scores the probes it was last given
    assert blocked(stack)


def test_a_probe_changed_on_disk_is_validated_and_pushed_to_the_workers(stack):
    probe_dir = stack.policy_path.parent / "probes" / "harmful-request"
    meta_path = probe_dir / "probe.yaml"
    original_meta = meta_path.read_text()
    stack.state.probes = ["sentinel"]  # any PUT to the worker replaces this

    r = reload(stack)
    assert r.status_code == 200 and "unchanged" in r.json()["message"]
    assert stack.state.probes == ["sentinel"], "an unchanged policy and probe set must not be pushed again"

    def edit_meta(**changes) -> dict:
        meta = yaml.safe_load(meta_path.read_text())
        meta.update(changes)
        meta_path.write_text(yaml.safe_dump(meta, sort_keys=False))
        return meta

    versions = {admin_policy(stack)["policy_version"]}
    edits = [
        ("calibration", lambda: edit_meta(calibration={"slope": 50.0, "intercept": -10.0})),
        ("layer", lambda: edit_meta(layer=5)),
        ("read", lambda: edit_meta(read="prompt_mean")),
        ("weights", lambda: save_file({"weight": -np.ones(8, np.float32), "bias": np.zeros(1, np.float32)},
                                      str(probe_dir / WEIGHTS_FILE))),
    ]
    for what, edit in edits:
        stack.state.probes = ["sentinel"]
        edit()
        versions.add(reload_after_edit(stack, versions))
        assert stack.state.probes == ["harmful-request"], f"a probe whose {what} changed was not pushed"
    assert len(versions) == 1 + len(edits)
    assert admin_policy(stack)["needs_recompute"] is True  # the edited read point is what the gateway serves

    # A probe broken in place is refused like any bad probe, and nothing is pushed.
    version = admin_policy(stack)["policy_version"]
    stack.state.probes = ["sentinel"]
    edit_meta(read="every_other_token")
    assert_refused(stack, reload(stack), version, "every_other_token")
    assert stack.state.probes == ["sentinel"]

    # Back to a valid tree: pushed once, then unchanged without a push.
    meta_path.write_text(original_meta)
    assert reload(stack).status_code == 200 and stack.state.probes == ["harmful-request"]
    stack.state.probes = ["sentinel"]
    before = admin_policy(stack)["policy_version"]
    stack.write_policy(base_policy(on_block="refusal"))
    reload_after_edit(stack, {before})
    assert stack.state.probes == ["sentinel"], "a change to the policy text alone needs no probe push"
    r = reload(stack)
    assert r.status_code == 200 and "unchanged" in r.json()["message"] and stack.state.probes == ["sentinel"]


def test_a_probe_with_an_out_of_range_calibration_is_refused(stack):
    root = stack.policy_path.parent / "probes"
    big = root / "big"
    big.mkdir()
    for f in (root / "harmful-request").iterdir():
        (big / f.name).write_bytes(f.read_bytes())
    meta = yaml.safe_load((big / "probe.yaml").read_text())
    meta.update(name="big", calibration={"slope": 10 ** 400, "intercept": 0.0})
    (big / "probe.yaml").write_text(yaml.safe_dump(meta))
    version = admin_policy(stack)["policy_version"]
    stack.state.probes = ["sentinel"]
    stack.write_policy(base_policy(probes={"harmful-request": {"path": "probes/harmful-request"},
                                           "big": {"path": "probes/big"}}))
    r = reload(stack)
    assert r.status_code == 400 and r.json()["error"]["code"] == "policy_rejected", r.text
    assert admin_policy(stack)["policy_version"] == version and stack.state.probes == ["sentinel"]


def test_an_unexpected_crash_in_a_reload_neither_answers_500_nor_stops_the_watcher(stack, monkeypatch):
    real_load_policy = policy_manager_module.load_policy
    armed = [True]

    def crash_once(path):
        if armed[0]:
            armed[0] = False
            raise KeyError("a bug nobody has met yet")
        return real_load_policy(path)

    version = admin_policy(stack)["policy_version"]
    errors_before = reload_errors(stack)
    monkeypatch.setattr(policy_manager_module, "load_policy", crash_once)
    stack.write_policy(base_policy(on_block="refusal"))  # the watcher's reload meets the crash
    deadline = time.monotonic() + 10
    while admin_policy(stack)["last_reload_error"] is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "KeyError" in (admin_policy(stack)["last_reload_error"] or ""), "the crash was not reported"
    assert reload_errors(stack) > errors_before
    assert admin_policy(stack)["policy_version"] == version  # the old policy stays until a reload works
    stack.write_policy(base_policy(rules=[]))
    version = wait_for_version_change(stack, version)

    armed[0] = True  # the file is unchanged now, so only the admin request reloads
    r = reload(stack)
    assert r.status_code == 400 and r.json()["error"]["code"] == "policy_rejected", r.text
    assert "KeyError" in r.json()["error"]["message"] and admin_policy(stack)["policy_version"] == version


def test_the_watcher_watches_again_after_the_file_watch_itself_fails(tmp_path, monkeypatch):
    import watchfiles

    policy_path = tmp_path / "policy.yaml"
    policy_path.write_text(yaml.safe_dump({}))
    calls = []

    async def flaky_awatch(directory, **kwargs):
        calls.append(directory)
        if len(calls) == 1:
            raise FileNotFoundError(directory)
        yield {(watchfiles.Change.modified, str(policy_path))}

    monkeypatch.setattr(watchfiles, "awatch", flaky_awatch)
    manager = PolicyManager(GatewayConfig(policy_path=policy_path, upstreams=[]), pool=None,
                            metrics=GatewayMetrics(), audit=None)
    reasons = []

    async def record(reason):
        reasons.append(reason)
        return True, ""

    manager.reload = record
    asyncio.run(asyncio.wait_for(manager.watch(), 10))
    assert len(calls) == 2 and reasons == ["file watch restarted", "file changed"]
