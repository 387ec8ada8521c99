# Sourced (bash) on the GPU host from the last carried part of the SGLang kit:
#     source .gpukit-sgl/pN/install-sglang.sh && python3 -m sglang.launch_server ...
# Copies this part next to the earlier ones (SGL_KIT_DIR, default /root/kit-sgl), verifies every
# part's checksums, unpacks the wheels into SGL_SITE (default /tmp/site-sgl; vLLM's kit uses
# /tmp/site), writes $SGL_KIT_DIR/env.sh and sources it, then installs this checkout there too.
# Environment: SGL_KIT_SKIP=transformers,tokenizers keeps the image's transformers instead of the
#              pinned 5.8.1; SGL_KIT_NO_CHECKOUT=1 skips installing the checkout; SGL_KIT_NO_PROBE=1
#              skips the closing line that imports torch and names the versions and the GPU.
_sgl_part=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
_sgl_kit=${SGL_KIT_DIR:-/root/kit-sgl}
_sgl_site=${SGL_SITE:-/tmp/site-sgl}
_sgl_py=${SGL_KIT_PYTHON:-python3}

_sgl_install() {
  mkdir -p "$_sgl_kit" || return 1
  if [ "$(cd "$_sgl_part/.." && pwd)" != "$(cd "$_sgl_kit" && pwd)" ]; then
    rm -rf "${_sgl_kit:?}/$(basename "$_sgl_part")"
    cp -r "$_sgl_part" "$_sgl_kit/" || return 1
  fi
  "$_sgl_py" "$_sgl_part/sglang_kit.py" install --kit "$_sgl_kit" --site "$_sgl_site" \
    --skip "${SGL_KIT_SKIP:-}" || return 1
  cat > "$_sgl_kit/env.sh" <<ENV
# SGLang runs only: the kit's site dir first, vLLM's /tmp/site left out.
_p=\$(printf '%s' "\${PYTHONPATH:-}" | tr ':' '\n' | grep -vx -e '$_sgl_site' -e /tmp/site -e '' | paste -sd: -)
export PYTHONPATH=$_sgl_site\${_p:+:\$_p}
unset _p
export PYTHONUNBUFFERED=1
ENV
  source "$_sgl_kit/env.sh"
  if [ -z "${SGL_KIT_NO_CHECKOUT:-}" ] && [ -f pyproject.toml ]; then
    "$_sgl_py" -m pip install -q --no-index --no-deps --no-build-isolation --upgrade --target "$_sgl_site" . \
      >/dev/null 2>&1 || echo "install-sglang: installing this checkout failed (its build backend must be on the image)" >&2
  fi
  [ -n "${SGL_KIT_NO_PROBE:-}" ] && return 0
  "$_sgl_py" - <<'PY' || return 1
import importlib.metadata as md
import torch
print(f"sglang {md.version('sglang')}, sglang-kernel {md.version('sglang-kernel')}, "
      f"transformers {md.version('transformers')}, torch {torch.__version__}, "
      f"{torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU'}")
PY
}
_sgl_install
_sgl_rc=$?
unset -f _sgl_install
unset _sgl_part _sgl_kit _sgl_site _sgl_py
[ "$_sgl_rc" = 0 ] || echo "install-sglang: failed (rc $_sgl_rc)" >&2
( exit "$_sgl_rc" )
