"""The offline SGLang kit: trims wheels, checks their dependency closure, packs them into parts
that fit one transfer each, and on the GPU host verifies the parts and unpacks them into a site dir.

Standard library only, except `check` (the closure check, run where the kit is built), which uses
`packaging`. The GPU host runs this file with the image's python3 from a carried part:

    python3 sglang_kit.py install --kit /root/kit-sgl --site /tmp/site-sgl

Here (scripts/gpu/build-sglang-kit.sh calls these):

    python3 sglang_kit.py trim  --wheels DIR           # rewrites the wheels in TRIM in place
    python3 sglang_kit.py check --wheels DIR           # every requirement met by the kit or the image
    python3 sglang_kit.py pack  --wheels DIR --kit OUT --extra install-sglang.sh
    python3 sglang_kit.py selfcheck --kit OUT          # unpacks into a temp dir, checks key files
"""

from __future__ import annotations

import argparse
import fnmatch
import hashlib
import json
import os
import re
import shutil
import sys
import tempfile
import time
import zipfile
from email.parser import Parser
from pathlib import Path

KIT_NAME = "sglang-0.5.14"
PART_LIMIT = 46_000_000  # bytes per part directory, manifest and scripts included
MANIFEST = "MANIFEST.json"
MARKER = ".sglang-kit.json"  # written into the site dir once it holds a kit

# What the GPU image already has (Python 3.12; versions where known). The kit never carries these,
# except the OVERRIDES below: a second copy of torch's compiled dependencies could shadow them.
IMAGE_VERSIONS = {
    "torch": "2.11.0", "torchaudio": "2.11.0", "torchvision": "0.26.0", "triton": "3.6.0",
    "transformers": "5.17.0", "tokenizers": "0.23.2", "huggingface-hub": "1.33.0",
    "safetensors": "0.8.0", "numpy": "2.5.2", "sentencepiece": "0.2.2", "tiktoken": "0.14.0",
    "accelerate": "1.15.0", "sentence-transformers": "6.0.1",
}
IMAGE_PACKAGES = set(IMAGE_VERSIONS) | set("""
absl-py aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs build certifi
charset-normalizer click cloudpickle cmake colorama contourpy cuda-bindings cuda-core cuda-pathfinder
cuda-toolkit cupy-cuda13x cycler cython einops filelock flatbuffers fonttools frozenlist fsspec grpcio
h11 h5py hf-xet httpcore httpx idna imageio iniconfig jinja2 joblib kiwisolver lazy-loader lxml
markdown markdown-it-py markupsafe matplotlib mdurl ml-dtypes mpmath msgpack multidict mypy-extensions
nanobind narwhals networkx ninja numba numba-cuda nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc
nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver
nvidia-cusparse nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink
nvidia-nvshmem-cu13 nvidia-nvtx onnx opencv-python-headless packaging pandas pathspec patsy peft
pillow pip pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11
py-cpuinfo pygments pyparsing pyproject-hooks python-dateutil pyyaml regex requests rich scikit-build-core
scikit-image scikit-learn scipy seaborn setuptools shellingham simplejson six sortedcontainers
sympy tabulate threadpoolctl tifffile timm toolz tqdm typer typing-extensions typing-inspect
urllib3 uvloop werkzeug wheel wrapt xxhash yarl zipp
""".split())
# Carried although the image has them: sglang 0.5.14 pins transformers==5.8.1, which in turn
# refuses the image's tokenizers (it checks tokenizers<=0.23.0 at import); the kit's pydantic needs a
# typing-extensions newer than the image may have (pure Python, backward compatible).
OVERRIDES = {"transformers", "tokenizers", "typing-extensions"}

# Files dropped from wheels. sglang-kernel: FlashAttention-3 (1.76 GB unpacked), the Blackwell
# build and FlashMLA; on a Hopper GPU sgl_kernel loads sm90/common_ops and guards the rest.
# xgrammar: its static library for C++ linking.
TRIM = {
    "sglang-kernel": ["sgl_kernel/flash_ops.*", "sgl_kernel/sm100/*", "sgl_kernel/flashmla_ops.*"],
    "xgrammar": ["xgrammar/lib/*.a"],
}

# Requirements deliberately not carried, with the reason (the closure check accepts these).
LEFT_OUT = {
    "flashinfer-cubin": "prebuilt flashinfer kernels; unused with --attention-backend triton --sampling-backend pytorch",
    "flash-attn-4": "FlashAttention-4 (Blackwell); imported only by its attention backend",
    "sgl-deep-gemm": "FP8 GEMMs; import guarded",
    "tilelang": "DeepSeek sparse attention kernels; imported lazily",
    "tokenspeed-mla": "MLA kernels; imported lazily",
    "quack-kernels": "CuTe DSL kernels; imported lazily",
    "nvidia-cutlass-dsl": "CuTe DSL (large); imports guarded in sglang and flashinfer",
    "nvidia-cudnn-frontend": "cuDNN attention in flashinfer; import guarded",
    "cuda-tile": "flashinfer's cuTile kernels; imported lazily",
    "nvidia-mathdx": "headers for one JIT kernel (load balancing); optional",
    "cuda-python": "metapackage; the image's cuda-bindings provides cuda.bindings",
    "torchao": "only with --torchao-config; imported lazily",
    "torchcodec": "video input; import guarded",
    "torch-memory-saver": "only with --enable-memory-saver; import guarded",
    "kernels": "hub-loaded kernels; imported lazily",
    "llguidance": "only with --grammar-backend llguidance",
    "outlines": "only with --grammar-backend outlines",
    "openai-harmony": "gpt-oss chat format; imported lazily",
    "mistral-common": "Mistral tokenizers; imported lazily",
    "modelscope": "only with SGLANG_USE_MODELSCOPE; import guarded",
    "datasets": "benchmarks only",
    "blobfile": "remote object stores only",
    "smg-grpc-servicer": "gRPC mode only",
    "anthropic": "not imported by the server",
    "py-spy": "debug dumps only (a command-line tool)",
    "easydict": "not imported on the server path",
    "watchfiles": "only for TLS certificate reloading",
    "jedi": "IPython's completer only; IPython.display does not import it",
}


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def wheel_dist(path: Path) -> tuple[str, str]:
    """(normalized name, version) from a wheel's file name."""
    parts = path.name[:-4].split("-")
    return normalize(parts[0]), parts[1]


def wheel_metadata(path: Path) -> tuple[str, str, list[str]]:
    """(normalized name, version, Requires-Dist lines) from a wheel's METADATA."""
    with zipfile.ZipFile(path) as zf:
        meta = next(n for n in zf.namelist() if re.fullmatch(r"[^/]+\.dist-info/METADATA", n))
        msg = Parser().parsestr(zf.read(meta).decode("utf-8"))
    return normalize(msg["Name"]), msg["Version"], msg.get_all("Requires-Dist") or []


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


# ---------------------------------------------------------------------------------------------
# trim

def trim_wheel(path: Path, patterns: list[str]) -> list[str]:
    """Rewrites the wheel without the members matching `patterns`; returns the names dropped."""
    tmp = path.with_suffix(".trim")
    dropped = []
    with zipfile.ZipFile(path) as src, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED, compresslevel=6) as dst:
        for info in src.infolist():
            if any(fnmatch.fnmatch(info.filename, p) for p in patterns):
                dropped.append(info.filename)
                continue
            with src.open(info) as fin, dst.open(info, "w", force_zip64=info.file_size > 2**31) as fout:
                shutil.copyfileobj(fin, fout, 1 << 20)
    if dropped:
        tmp.replace(path)
    else:
        tmp.unlink()
    return dropped


def trim_dir(wheels: Path, trim: dict[str, list[str]] = TRIM) -> dict[str, list[str]]:
    done = {}
    for w in sorted(wheels.glob("*.whl")):
        name, _ = wheel_dist(w)
        if name in trim:
            done[w.name] = trim_wheel(w, trim[name])
    return done


def drop_image_packages(wheels: Path, image=IMAGE_PACKAGES, overrides=OVERRIDES) -> list[str]:
    """Deletes the wheels of packages the image already has (OVERRIDES excepted)."""
    gone = []
    for w in sorted(wheels.glob("*.whl")):
        name, _ = wheel_dist(w)
        if name in image and name not in overrides:
            w.unlink()
            gone.append(w.name)
    return gone


# ---------------------------------------------------------------------------------------------
# check

TARGET_ENV = {
    "python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
    "platform_machine": "x86_64", "platform_system": "Linux", "os_name": "posix",
    "implementation_name": "cpython", "platform_python_implementation": "CPython", "extra": "",
}


def check_closure(wheels: Path, image_versions=IMAGE_VERSIONS, image=IMAGE_PACKAGES,
                  left_out=LEFT_OUT) -> dict:
    """Every requirement of every kit wheel (markers evaluated for CPython 3.12 on Linux x86_64)
    must be met by a kit wheel, by the image (its version checked where known) or be in LEFT_OUT.
    Returns {"problems": [...], "assumed": [...], "left_out": [...]}; problems empty means closed."""
    from packaging.requirements import Requirement
    from packaging.version import Version

    kit = {}
    for w in sorted(wheels.glob("*.whl")):
        name, version, reqs = wheel_metadata(w)
        if name in kit:
            raise SystemExit(f"two wheels of {name} in {wheels}")
        kit[name] = (version, reqs)
    problems, assumed, skipped = [], set(), set()
    for name, (_, reqs) in sorted(kit.items()):
        for line in reqs:
            req = Requirement(line)
            if req.marker is not None and not req.marker.evaluate(TARGET_ENV):
                continue
            dep = normalize(req.name)
            if dep in kit:
                have = kit[dep][0]
                if not req.specifier.contains(Version(have), prereleases=True):
                    problems.append(f"{name} needs {line}; the kit has {dep} {have}")
            elif dep in image:
                have = image_versions.get(dep)
                if have is None:
                    if str(req.specifier):
                        assumed.add(f"{dep}{req.specifier} (image, version not recorded)")
                elif not req.specifier.contains(Version(have), prereleases=True):
                    problems.append(f"{name} needs {line}; the image has {dep} {have}")
            elif dep in left_out:
                skipped.add(f"{dep} ({left_out[dep]})")
            else:
                problems.append(f"{name} needs {line}: not in the kit, the image or LEFT_OUT")
    for name in kit:
        if name in image and name not in OVERRIDES:
            problems.append(f"{name} is carried although the image has it")
    return {"wheels": len(kit), "problems": problems, "assumed": sorted(assumed), "left_out": sorted(skipped)}


# ---------------------------------------------------------------------------------------------
# pack

def plan_parts(sizes: dict[str, int], limit: int, reserve: int) -> list[list[str]]:
    """First-fit decreasing: lists of file names whose sizes add up to at most limit - reserve."""
    room = limit - reserve
    parts: list[list[str]] = []
    used: list[int] = []
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        if sizes[name] > room:
            raise ValueError(f"{name} ({sizes[name]} bytes) does not fit a part of {room} bytes")
        for i, u in enumerate(used):
            if u + sizes[name] <= room:
                parts[i].append(name)
                used[i] += sizes[name]
                break
        else:
            parts.append([name])
            used.append(sizes[name])
    return parts


def pack(wheels: Path, kit: Path, extras: list[Path], limit: int = PART_LIMIT) -> list[dict]:
    """Writes kit/p1 .. kit/pN: the wheels, the installer files (in every part, so any part can be
    the last one carried) and a MANIFEST.json naming the part, the whole kit and its checksums."""
    files = sorted(wheels.glob("*.whl"))
    sizes = {f.name: f.stat().st_size for f in files}
    digests = {f.name: sha256(f) for f in files}
    installer = [Path(__file__).resolve(), *[Path(e).resolve() for e in extras]]
    installer_bytes = sum(p.stat().st_size for p in installer)
    reserve = installer_bytes + 4096 + 320 * len(files)  # the manifest's room
    plan = plan_parts(sizes, limit, reserve)
    kit_id = hashlib.sha256("".join(f"{n}:{digests[n]}\n" for n in sorted(digests)).encode()).hexdigest()[:16]
    if kit.exists():
        shutil.rmtree(kit)
    manifests = []
    for i, names in enumerate(plan, 1):
        d = kit / f"p{i}"
        d.mkdir(parents=True)
        for n in names:
            shutil.copy2(wheels / n, d / n)
        for p in installer:
            shutil.copy2(p, d / p.name)
        manifest = {
            "kit": KIT_NAME, "kit_id": kit_id, "part": i, "parts": len(plan),
            "files": [{"name": n, "size": sizes[n], "sha256": digests[n]} for n in sorted(names)],
            "installer": {p.name: sha256(d / p.name) for p in installer},
            "all_files": {n: digests[n] for n in sorted(digests)},
        }
        (d / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
        total = sum(f.stat().st_size for f in d.iterdir())
        if total > limit:
            raise ValueError(f"part {i} is {total} bytes, over {limit}")
        manifest["bytes"] = total
        manifests.append(manifest)
    summary = {"kit": KIT_NAME, "kit_id": kit_id, "parts": [{"part": m["part"], "bytes": m["bytes"],
               "files": len(m["files"])} for m in manifests], "bytes": sum(m["bytes"] for m in manifests)}
    (kit / "KIT.json").write_text(json.dumps(summary, indent=1) + "\n")
    return manifests


# ---------------------------------------------------------------------------------------------
# verify and install (GPU host: standard library only)

def verify(kit: Path) -> dict:
    """Checks that every part of one kit is under `kit` (p1..pN, any folder names) and that every
    wheel has its recorded size and sha256. Returns {"kit_id", "parts", "wheels": [paths]}."""
    manifests = []
    for m in sorted(kit.glob(f"*/{MANIFEST}")):
        manifests.append((m.parent, json.loads(m.read_text())))
    if not manifests:
        raise SystemExit(f"sglang kit: no part under {kit} (each part folder holds {MANIFEST})")
    ids = {man["kit_id"] for _, man in manifests}
    if len(ids) > 1:
        raise SystemExit(f"sglang kit: parts of different kits under {kit}: {sorted(ids)}; remove the stale ones")
    want = manifests[0][1]["parts"]
    have = {}
    for d, man in manifests:
        have.setdefault(man["part"], (d, man))
    missing = [i for i in range(1, want + 1) if i not in have]
    if missing:
        raise SystemExit(f"sglang kit: part(s) {missing} of {want} missing under {kit}")
    wheels, expected = [], manifests[0][1]["all_files"]
    for i in range(1, want + 1):
        d, man = have[i]
        for f in man["files"]:
            p = d / f["name"]
            if not p.is_file():
                raise SystemExit(f"sglang kit: {p} missing")
            if p.stat().st_size != f["size"] or sha256(p) != f["sha256"]:
                raise SystemExit(f"sglang kit: {p} is damaged (size or sha256 differs from the manifest)")
            wheels.append(p)
    names = sorted(p.name for p in wheels)
    if names != sorted(expected):
        raise SystemExit(f"sglang kit: the parts hold {len(names)} wheels, the kit {len(expected)}")
    return {"kit_id": manifests[0][1]["kit_id"], "parts": want, "wheels": wheels}


def unpack_wheel(path: Path, site: Path) -> int:
    """Unzips one wheel as an install would: `*.data/purelib|platlib` into the site dir, scripts into
    site/bin, other .data folders skipped. Keeps the files' permission bits. Returns files written."""
    n = 0
    with zipfile.ZipFile(path) as zf:
        for info in zf.infolist():
            name = info.filename
            if name.endswith("/"):
                continue
            parts = name.split("/")
            if parts[0].endswith(".data"):
                if len(parts) < 3:
                    continue
                if parts[1] in ("purelib", "platlib"):
                    rel = "/".join(parts[2:])
                elif parts[1] == "scripts":
                    rel = "bin/" + "/".join(parts[2:])
                else:
                    continue
            else:
                rel = name
            dest = site / rel
            if ".." in Path(rel).parts or Path(rel).is_absolute():
                raise SystemExit(f"sglang kit: unsafe path {name} in {path.name}")
            dest.parent.mkdir(parents=True, exist_ok=True)
            with zf.open(info) as fin, open(dest, "wb") as fout:
                shutil.copyfileobj(fin, fout, 1 << 20)
            mode = (info.external_attr >> 16) & 0o777
            if parts[0].endswith(".data") and parts[1] == "scripts":
                mode |= 0o755
            if mode:
                os.chmod(dest, mode | 0o400)
            n += 1
    return n


def install(kit: Path, site: Path, skip: set[str] = frozenset()) -> dict:
    """Verifies the kit, then unpacks its wheels (those of `skip` excepted) into `site`. A site dir
    that already holds this kit (same kit_id and skip set) is left as it is."""
    t0 = time.monotonic()
    found = verify(kit)
    skip = {normalize(s) for s in skip if s}
    marker = site / MARKER
    state = {"kit": KIT_NAME, "kit_id": found["kit_id"], "skip": sorted(skip)}
    if marker.is_file() and json.loads(marker.read_text()) == state:
        return {**state, "parts": found["parts"], "wheels": 0, "files": 0, "reused": True,
                "seconds": round(time.monotonic() - t0, 1)}
    if site.exists():
        shutil.rmtree(site)
    site.mkdir(parents=True)
    files = wheels = 0
    for w in sorted(found["wheels"], key=lambda p: p.name):
        if wheel_dist(w)[0] in skip:
            continue
        files += unpack_wheel(w, site)
        wheels += 1
    marker.write_text(json.dumps(state) + "\n")
    return {**state, "parts": found["parts"], "wheels": wheels, "files": files, "reused": False,
            "seconds": round(time.monotonic() - t0, 1)}


def site_bytes(site: Path) -> int:
    return sum(p.stat().st_size for p in site.rglob("*") if p.is_file())


EXPECTED_FILES = ["sglang/launch_server.py", "sgl_kernel/__init__.py", "sgl_kernel/sm90/common_ops.abi3.so",
                  "sgl_kernel/load_utils.py", "flashinfer/sampling.py", "xgrammar/__init__.py", "tvm_ffi/__init__.py"]
ABSENT_FILES = ["sgl_kernel/flash_ops.abi3.so", "sgl_kernel/sm100", "xgrammar/lib/libxgrammar.a"]
EXPECTED_DISTS = ["sglang-0.5.14", "sglang_kernel-0.4.4", "flashinfer_python-0.6.12", "transformers-5.8.1"]


def selfcheck(kit: Path) -> list[str]:
    """Installs the kit into a temporary site dir and checks the files the server needs are there
    (and the trimmed ones are not). Returns the problems found."""
    problems = []
    with tempfile.TemporaryDirectory() as tmp:
        site = Path(tmp) / "site"
        info = install(kit, site)
        for rel in EXPECTED_FILES:
            if not (site / rel).is_file():
                problems.append(f"missing {rel}")
        for rel in ABSENT_FILES:
            if (site / rel).exists():
                problems.append(f"not trimmed: {rel}")
        for dist in EXPECTED_DISTS:
            if not (site / f"{dist}.dist-info" / "METADATA").is_file():
                problems.append(f"missing {dist}.dist-info (sglang checks sglang-kernel's version at start)")
        print(f"selfcheck: {info['wheels']} wheels, {info['files']} files, "
              f"{site_bytes(site) / 1e6:.0f} MB unpacked, {len(problems)} problem(s)")
    return problems


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("trim", "check", "pack", "selfcheck", "verify", "install", "drop-image"):
        p = sub.add_parser(name)
        if name in ("trim", "check", "pack", "drop-image"):
            p.add_argument("--wheels", type=Path, required=True)
        if name in ("pack", "selfcheck", "verify", "install"):
            p.add_argument("--kit", type=Path, required=True)
        if name == "pack":
            p.add_argument("--extra", type=Path, action="append", default=[])
            p.add_argument("--limit", type=int, default=PART_LIMIT)
        if name == "install":
            p.add_argument("--site", type=Path, required=True)
            p.add_argument("--skip", default="", help="comma-separated packages not to unpack")
    a = ap.parse_args(argv)
    if a.cmd == "drop-image":
        for n in drop_image_packages(a.wheels):
            print(f"  image has it: {n}")
    elif a.cmd == "trim":
        for wheel, dropped in trim_dir(a.wheels).items():
            print(f"  trimmed {wheel}: {len(dropped)} file(s) dropped")
    elif a.cmd == "check":
        r = check_closure(a.wheels)
        print(f"closure: {r['wheels']} wheels; {len(r['left_out'])} requirement(s) left out on purpose; "
              f"{len(r['assumed'])} met by image packages of unrecorded version")
        for line in r["assumed"]:
            print(f"  assumed: {line}")
        for line in r["problems"]:
            print(f"  PROBLEM: {line}")
        return 1 if r["problems"] else 0
    elif a.cmd == "pack":
        for m in pack(a.wheels, a.kit, a.extra, a.limit):
            print(f"  p{m['part']}: {m['bytes'] / 1e6:.1f} MB, {len(m['files'])} wheel(s)")
    elif a.cmd == "selfcheck":
        problems = selfcheck(a.kit)
        for p in problems:
            print(f"  PROBLEM: {p}")
        return 1 if problems else 0
    elif a.cmd == "verify":
        v = verify(a.kit)
        print(f"sglang kit {v['kit_id']}: {v['parts']} part(s), {len(v['wheels'])} wheels, checksums match")
    elif a.cmd == "install":
        r = install(a.kit, a.site, set(a.skip.split(",")))
        how = "already there" if r["reused"] else f"{r['wheels']} wheels unpacked ({r['files']} files)"
        print(f"sglang kit {r['kit_id']}: {r['parts']} part(s) verified, {how} into {a.site} in {r['seconds']} s"
              + (f"; not unpacked: {','.join(r['skip'])}" if r["skip"] else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
