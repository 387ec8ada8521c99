#!/bin/bash
# On the GPU machine: run one long command in the background, so that it outlives the device
# call that started it (one call may last at most 10 minutes; a bench run takes longer).
#
#   bash bench/gpu/background.sh NAME COMMAND [ARGS...]
#
# The command runs from /root (so Python imports the checkout installed into /tmp/site by
# the kit, not the call's copy of the working tree, which is gone after the call), with the
# kit's environment. PROBEX_BG_ENV names another environment script (the SGLang kit's
# /root/kit-sgl/env.sh) and PROBEX_BG_CWD another folder to run from (a copy of the checkout
# made outside the call's working tree, for modules of bench/, which no kit installs).
# Its output goes to /root/runs/NAME.out and, when it ends,
# "NAME done rc=N" to /root/runs/all.log, which `poll.sh` waits for. Commands started one
# after another run in that order, each once the one before is done, never two on the GPU at
# once.
set -eu
name=$1; shift
mkdir -p /root/runs
script=/root/runs/.$name.sh
before=$(cat /root/runs/.last 2>/dev/null || true)
{
  printf 'source %q; cd %q\n' "${PROBEX_BG_ENV:-/root/kit/env.sh}" "${PROBEX_BG_CWD:-/root}"
  [ -n "$before" ] && echo "until grep -q '^$before done' /root/runs/all.log 2>/dev/null; do sleep 1; done"
  printf '%q ' "$@"; echo "> /root/runs/$name.out 2>&1"
  echo "echo \"$name done rc=\$?\" >> /root/runs/all.log"
} > "$script"
echo "$name" > /root/runs/.last
setsid nohup bash "$script" > /dev/null 2>&1 < /dev/null &
echo "$name started: /root/runs/$name.out"
