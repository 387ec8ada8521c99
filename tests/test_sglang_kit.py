"""The offline SGLang kit's packer and installer (scripts/gpu/sglang_kit.py, install-sglang.sh) on
small fake wheels built here: trimming, the closure check, packing into parts under a size limit,
checksum verification, unpacking into a site dir, and the shell installer end to end. Nothing is
downloaded; the real build is scripts/gpu/build-sglang-kit.sh."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

GPU = Path(__file__).resolve().parents[1] / "scripts" / "gpu"
_spec = importlib.util.spec_from_file_location("sglang_kit", GPU / "sglang_kit.py")
kit_mod = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(kit_mod)


def make_wheel(folder: Path, name: str, version: str, files: dict[str, bytes] | None = None,
               requires: list[str] = (), tag: str = "py3-none-any", mode: int = 0o644) -> Path:
    """A minimal wheel: the given files, METADATA with Requires-Dist, WHEEL and RECORD."""
    folder.mkdir(parents=True, exist_ok=True)
    dist = f"{name.replace('-', '_')}-{version}"
    path = folder / f"{dist}-{tag}.whl"
    meta = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n" + "".join(
        f"Requires-Dist: {r}\n" for r in requires)
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        for rel, data in (files or {f"{name.replace('-', '_')}/__init__.py": b"x = 1\n"}).items():
            info = zipfile.ZipInfo(rel)
            info.external_attr = (mode if not rel.endswith(".sh") else 0o755) << 16
            zf.writestr(info, data)
        zf.writestr(f"{dist}.dist-info/METADATA", meta)
        zf.writestr(f"{dist}.dist-info/WHEEL", "Wheel-Version: 1.0\n")
        zf.writestr(f"{dist}.dist-info/RECORD", "")
    return path


def noise(n: int, seed: int) -> bytes:
    """Incompressible bytes, so a wheel's size is about n."""
    import random
    return random.Random(seed).randbytes(n)


def test_trim_drops_only_the_matching_members_and_keeps_the_metadata(tmp_path):
    w = make_wheel(tmp_path, "sglang-kernel", "0.4.4", {
        "sgl_kernel/__init__.py": b"", "sgl_kernel/flash_ops.abi3.so": b"F" * 1000,
        "sgl_kernel/sm90/common_ops.abi3.so": b"9", "sgl_kernel/sm100/common_ops.abi3.so": b"1",
        "sgl_kernel/flashmla_ops.abi3.so": b"M"})
    make_wheel(tmp_path, "other", "1.0", {"other/flash_ops.abi3.so": b"keep"})
    done = kit_mod.trim_dir(tmp_path)
    assert sorted(Path(n).name for n in done[w.name]) == ["common_ops.abi3.so", "flash_ops.abi3.so",
                                                         "flashmla_ops.abi3.so"]
    names = zipfile.ZipFile(w).namelist()
    assert "sgl_kernel/sm90/common_ops.abi3.so" in names and "sgl_kernel/__init__.py" in names
    assert not any("sm100" in n or "flash" in n for n in names)
    assert "sglang_kernel-0.4.4.dist-info/METADATA" in names  # sglang checks its version at start
    assert "other/flash_ops.abi3.so" in zipfile.ZipFile(tmp_path / "other-1.0-py3-none-any.whl").namelist()


def test_the_kit_trims_fa3_blackwell_and_flashmla_but_keeps_the_hopper_build():
    import fnmatch
    pats = kit_mod.TRIM["sglang-kernel"]
    gone = lambda n: any(fnmatch.fnmatch(n, p) for p in pats)  # noqa: E731
    assert gone("sgl_kernel/flash_ops.abi3.so") and gone("sgl_kernel/sm100/common_ops.abi3.so")
    assert not gone("sgl_kernel/sm90/common_ops.abi3.so") and not gone("sgl_kernel/load_utils.py")
    assert not gone("sgl_kernel/spatial_ops.abi3.so") and not gone("triton_kernels/matmul_ogs.py")


def test_image_packages_are_dropped_except_the_overrides(tmp_path):
    make_wheel(tmp_path, "numpy", "2.5.5")
    make_wheel(tmp_path, "transformers", "5.8.1")
    make_wheel(tmp_path, "orjson", "3.13.0")
    gone = kit_mod.drop_image_packages(tmp_path)
    assert gone == ["numpy-2.5.5-py3-none-any.whl"]
    assert sorted(p.name.split("-")[0] for p in tmp_path.glob("*.whl")) == ["orjson", "transformers"]


def test_the_closure_check_accepts_a_closed_kit(tmp_path):
    make_wheel(tmp_path, "sglang", "0.5.14", requires=[
        "torch==2.11.0", "fastapi", "flash-attn-4==4.0.0b15", 'av; platform_machine == "aarch64"',
        'pytest; extra == "test"', "packaging"])
    make_wheel(tmp_path, "fastapi", "0.165.0", requires=["starlette>=0.40"])
    make_wheel(tmp_path, "starlette", "1.10.0")
    r = kit_mod.check_closure(tmp_path, image_versions={"torch": "2.11.0+cu130"},
                              image={"torch", "packaging"}, left_out={"flash-attn-4": "why"})
    assert r["problems"] == [] and r["wheels"] == 3
    assert r["left_out"] == ["flash-attn-4 (why)"]


def test_the_closure_check_names_every_gap(tmp_path):
    make_wheel(tmp_path, "sglang", "0.5.14", requires=["torch==2.11.0", "missing-pkg", "starlette<1",
                                                      "tokenizers<=0.23.0", "typer>=1"])
    make_wheel(tmp_path, "starlette", "1.10.0")
    make_wheel(tmp_path, "numpy", "2.5.5")
    r = kit_mod.check_closure(tmp_path, image_versions={"torch": "2.10.0", "tokenizers": "0.23.2"},
                              image={"torch", "tokenizers", "numpy", "typer"}, left_out={})
    text = "\n".join(r["problems"])
    assert "missing-pkg" in text and "not in the kit" in text
    assert "the kit has starlette 1.10.0" in text
    assert "the image has torch 2.10.0" in text and "the image has tokenizers 0.23.2" in text
    assert "numpy is carried although the image has it" in text
    assert r["assumed"] == ["typer>=1 (image, version not recorded)"]


def test_parts_are_packed_first_fit_decreasing_under_the_limit():
    sizes = {"a": 40, "b": 30, "c": 30, "d": 20, "e": 10}
    parts = kit_mod.plan_parts(sizes, limit=70, reserve=10)
    assert parts == [["a", "d"], ["b", "c"], ["e"]]
    assert all(sum(sizes[n] for n in p) <= 60 for p in parts)
    with pytest.raises(ValueError, match="does not fit"):
        kit_mod.plan_parts({"huge": 61}, limit=70, reserve=10)


def build_kit(tmp_path: Path, limit: int = 100_000, seed: int = 0) -> tuple[Path, list[dict]]:
    wheels = tmp_path / "wheels"
    make_wheel(wheels, "sglang", "0.5.14", {"sglang/launch_server.py": b"print('serve')\n",
                                            "sglang/srt/blob.bin": noise(40_000, seed + 1)})
    make_wheel(wheels, "sglang-kernel", "0.4.4", {"sgl_kernel/__init__.py": b"",
                                                  "sgl_kernel/sm90/common_ops.abi3.so": noise(35_000, seed + 2)})
    make_wheel(wheels, "transformers", "5.8.1", {"transformers/__init__.py": noise(20_000, seed + 3)})
    make_wheel(wheels, "dill", "0.4.1", {"dill/__init__.py": b"", "dill-0.4.1.data/scripts/undill": b"#!x\n",
                                         "dill-0.4.1.data/data/share/man.1": b"man"})
    make_wheel(wheels, "pkg-purelib", "1.0", {"pkg_purelib-1.0.data/purelib/pkg_purelib/__init__.py": b"y = 2\n"})
    kit = tmp_path / "repo" / ".gpukit-sgl"
    manifests = kit_mod.pack(wheels, kit, [GPU / "install-sglang.sh"], limit=limit)
    return kit, manifests


def test_pack_writes_parts_under_the_limit_each_with_a_manifest_and_the_installer(tmp_path):
    kit, manifests = build_kit(tmp_path)
    assert len(manifests) >= 2
    seen = []
    for m in manifests:
        d = kit / f"p{m['part']}"
        assert sum(f.stat().st_size for f in d.iterdir()) <= 100_000
        on_disk = json.loads((d / "MANIFEST.json").read_text())
        assert on_disk["parts"] == len(manifests) and on_disk["kit_id"] == manifests[0]["kit_id"]
        assert (d / "install-sglang.sh").is_file() and (d / "sglang_kit.py").is_file()
        for f in on_disk["files"]:
            assert kit_mod.sha256(d / f["name"]) == f["sha256"]
            seen.append(f["name"])
    assert sorted(seen) == sorted(manifests[0]["all_files"]) and len(seen) == 5
    summary = json.loads((kit / "KIT.json").read_text())
    assert summary["bytes"] == sum(m["bytes"] for m in manifests)


def test_install_unpacks_every_wheel_and_reuses_a_site_that_holds_the_kit(tmp_path):
    kit, manifests = build_kit(tmp_path)
    site = tmp_path / "site-sgl"
    r = kit_mod.install(kit, site)
    assert r["wheels"] == 5 and not r["reused"] and r["parts"] == len(manifests)
    assert (site / "sglang" / "launch_server.py").read_text() == "print('serve')\n"
    assert (site / "sgl_kernel" / "sm90" / "common_ops.abi3.so").is_file()
    assert (site / "sglang_kernel-0.4.4.dist-info" / "METADATA").is_file()
    assert (site / "pkg_purelib" / "__init__.py").read_text() == "y = 2\n"  # .data/purelib to the root
    assert os.access(site / "bin" / "undill", os.X_OK)  # .data/scripts to bin/
    assert not (site / "share").exists() and not list(site.glob("*.data"))
    again = kit_mod.install(kit, site)
    assert again["reused"] and again["wheels"] == 0
    skipped = kit_mod.install(kit, site, skip={"transformers"})
    assert not skipped["reused"] and not (site / "transformers").exists() and skipped["wheels"] == 4


def test_verify_refuses_a_damaged_a_missing_or_a_foreign_part(tmp_path):
    kit, manifests = build_kit(tmp_path)
    assert kit_mod.verify(kit)["parts"] == len(manifests)
    m = manifests[-1]
    victim = kit / f"p{m['part']}" / m["files"][0]["name"]
    data = bytearray(victim.read_bytes())
    data[-30] ^= 0xFF
    victim.write_bytes(bytes(data))
    with pytest.raises(SystemExit, match="damaged"):
        kit_mod.verify(kit)
    victim.unlink()
    with pytest.raises(SystemExit, match="missing"):
        kit_mod.verify(kit)
    import shutil
    shutil.rmtree(kit / "p1")
    with pytest.raises(SystemExit, match=r"part\(s\) \[1\]"):
        kit_mod.verify(kit)
    other, _ = build_kit(tmp_path / "other", seed=10)
    shutil.copytree(other / "p1", kit / "p1")
    with pytest.raises(SystemExit, match="different kits"):
        kit_mod.verify(kit)


def test_the_shell_installer_collects_the_parts_verifies_and_writes_env_sh(tmp_path):
    kit, manifests = build_kit(tmp_path)
    n = len(manifests)
    repo, collected, site = kit.parent, tmp_path / "kit-sgl", tmp_path / "site-sgl"
    collected.mkdir()
    for i in range(1, n):  # the earlier transfers: copy the part out of the checkout
        subprocess.run(["cp", "-r", str(kit / f"p{i}"), str(collected)], check=True)
    env = {**os.environ, "SGL_KIT_DIR": str(collected), "SGL_SITE": str(site), "SGL_KIT_PYTHON": sys.executable,
           "SGL_KIT_NO_CHECKOUT": "1", "SGL_KIT_NO_PROBE": "1", "PYTHONPATH": "/tmp/site:/opt/other"}
    script = (f"source .gpukit-sgl/p{n}/install-sglang.sh && echo \"PP=$PYTHONPATH\" && "
              f"test -f {collected}/env.sh")
    out = subprocess.run(["bash", "-c", script], cwd=repo, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert lines[0].startswith("sglang kit ") and f"{n} part(s) verified, 5 wheels unpacked" in lines[0]
    assert lines[-1] == f"PP={site}:/opt/other"  # vLLM's /tmp/site is left out
    assert (site / "sglang" / "launch_server.py").is_file()
    later = subprocess.run(["bash", "-c", f"source {collected}/env.sh && echo $PYTHONPATH"], env=env,
                           capture_output=True, text=True, timeout=30)
    assert later.stdout.strip() == f"{site}:/opt/other"
    # the same command again: the site dir already holds the kit
    again = subprocess.run(["bash", "-c", script], cwd=repo, env=env, capture_output=True, text=True, timeout=60)
    assert again.returncode == 0 and "already there" in again.stdout


def test_the_shell_installer_fails_when_a_part_was_not_carried(tmp_path):
    kit, manifests = build_kit(tmp_path)
    env = {**os.environ, "SGL_KIT_DIR": str(tmp_path / "kit-sgl"), "SGL_SITE": str(tmp_path / "site"),
           "SGL_KIT_PYTHON": sys.executable, "SGL_KIT_NO_CHECKOUT": "1", "SGL_KIT_NO_PROBE": "1"}
    n = len(manifests)
    out = subprocess.run(["bash", "-c", f"source .gpukit-sgl/p{n}/install-sglang.sh && echo RAN"],
                         cwd=kit.parent, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "RAN" not in out.stdout and "missing" in out.stderr


def test_the_scripts_parse():
    for script in ("build-sglang-kit.sh", "install-sglang.sh"):
        subprocess.run(["bash", "-n", str(GPU / script)], check=True)
