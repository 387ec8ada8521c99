#!/usr/bin/env bash
# Builds .gpukit-sgl/p1 .. pN in this checkout: SGLang 0.5.14 and what `python -m sglang.launch_server
# --attention-backend triton --sampling-backend pytorch` imports, for an air-gapped Hopper GPU host
# whose image has Python 3.12, torch 2.11.0+cu130 (with its nvidia-* CUDA wheels), triton 3.6 and
# transformers 5.17. Each part is at most 46 MB, so it fits one 64 MiB transfer with the checkout.
# Usage (from anywhere in the checkout; needs pip and PyPI; ~700 MB of downloads, most of it the
# sglang-kernel wheel, which is trimmed to its Hopper build):
#     bash scripts/gpu/build-sglang-kit.sh
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(git -C "$here" rev-parse --show-toplevel)
kit="$root/.gpukit-sgl"
py=${PYTHON:-python3}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/wheels"

plat=(--only-binary=:all: --python-version 3.12 --implementation cp)
for t in manylinux2014_x86_64 manylinux_2_17_x86_64 manylinux_2_24_x86_64 manylinux_2_26_x86_64 \
         manylinux_2_27_x86_64 manylinux_2_28_x86_64 manylinux_2_31_x86_64 manylinux_2_34_x86_64 \
         manylinux_2_35_x86_64 manylinux1_x86_64 manylinux2010_x86_64; do
  plat+=(--platform "$t"); done
download() { pip download -q "${plat[@]}" -d "$work/wheels" "$@" 2>&1 | grep -v '^WARNING: Location' || true; }

echo "== sglang and the packages it pins that need torch (no dependencies: torch is the image's)"
download --no-deps sglang==0.5.14 sglang-kernel==0.4.4 flashinfer-python==0.6.12 xgrammar==0.2.1 \
  apache-tvm-ffi==0.1.9 compressed-tensors==0.17.1 transformers==5.8.1 tokenizers==0.22.2

echo "== what the server imports that the image lacks, with their dependencies"
# openai/xgrammar/soundfile: sglang's pins; ipython 9.19: its IPython.display imports no completer or
# terminal code (jedi is left out); compressed-tensors needs loguru; the rest are sglang's imports.
download "fastapi" "uvicorn" "python-multipart" "pydantic>=2" "orjson" "msgspec" "pybase64" "setproctitle" \
  "partial_json_parser" "pyzmq>=25.1.2" "jsonschema" "dill" "interegular" "loguru" "gguf" \
  "soundfile==0.13.1" "openai==2.6.1" "ipython==9.19.1"
rm -f "$work"/wheels/jedi-*.whl "$work"/wheels/parso-*.whl

echo "== drop what the image has, trim, check the closure"
echo "  left to the image: $("$py" "$here/sglang_kit.py" drop-image --wheels "$work/wheels" | wc -l) wheel(s)"
"$py" "$here/sglang_kit.py" trim --wheels "$work/wheels"
"$py" "$here/sglang_kit.py" check --wheels "$work/wheels"

echo "== pack into parts of at most 46 MB"
"$py" "$here/sglang_kit.py" pack --wheels "$work/wheels" --kit "$kit" --extra "$here/install-sglang.sh"
"$py" "$here/sglang_kit.py" selfcheck --kit "$kit"
n=$(ls -d "$kit"/p* | wc -l)
"$py" -c 'import json,sys; k=json.load(open(sys.argv[1])); print("  total %.1f MB in %d parts (kit %s)" % (k["bytes"]/1e6, len(k["parts"]), k["kit_id"]))' "$kit/KIT.json"
echo "Kit ready: $n parts. On the GPU host, one transfer per part, in order (each with the checkout):"
for i in $(seq 1 $((n - 1))); do
  echo "  transfer $i: .gpukit-sgl/p$i   then: mkdir -p /root/kit-sgl && cp -r .gpukit-sgl/p$i /root/kit-sgl/"
done
echo "  transfer $n: .gpukit-sgl/p$n   then: source .gpukit-sgl/p$n/install-sglang.sh && <your command>"
echo "  later, on the same host: source /root/kit-sgl/env.sh && <your command>"
