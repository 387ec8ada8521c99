#!/bin/bash
# On the GPU machine: wait (at most SECONDS) until /root/runs/all.log says "NAME done", then
# hand back what the runs wrote so far under $OUT/runs: each run's bench_engine.json and
# sglang_smoke.json gzipped, its charts, and the tails of its output and server logs (logs.tar.gz).
#
#   bash bench/gpu/poll.sh SECONDS NAME
#
# Call it again at once when it returns before NAME is done: a machine left idle for 30 s
# between two calls is given back, and the runs on it are lost.
set -u
limit=$1; name=$2
# A machine given back (idle for 30 s between calls) is replaced by a fresh, bare one: the run
# is gone, and waiting would spend device time on nothing. Say so at once.
if [ ! -f "/root/runs/.$name.sh" ]; then
  echo "poll: no run $name on this machine (a fresh one: the machine that ran it was given back)"
  exit 3
fi
for ((waited = 0; waited < limit; waited += 5)); do
  grep -q "^$name done" /root/runs/all.log 2>/dev/null && break
  sleep 5
done
mkdir -p "$OUT/runs" /tmp/tails
cd /root/runs
for f in */bench_engine.json; do [ -f "$f" ] && gzip -c "$f" > "$OUT/runs/$(dirname "$f").json.gz"; done
for f in */sglang_smoke.json; do [ -f "$f" ] && gzip -c "$f" > "$OUT/runs/$(dirname "$f")-sglang_smoke.json.gz"; done
cp ./*/*.png "$OUT/runs/" 2>/dev/null
rm -rf /tmp/tails/*
for f in *.out */*.log; do
  [ -f "$f" ] && mkdir -p "/tmp/tails/$(dirname "$f")" && tail -c 300000 "$f" > "/tmp/tails/$f"
done
tar -czf "$OUT/runs/logs.tar.gz" -C /tmp/tails . 2>/dev/null
cat /root/runs/all.log 2>/dev/null
for f in *.out; do [ -f "$f" ] && { echo "== $f"; tail -n 6 "$f"; }; done
grep -q "^$name done" /root/runs/all.log 2>/dev/null && echo "poll: $name done" || echo "poll: $name still running"
