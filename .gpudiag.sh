#!/bin/bash
# session-6 diagnostic runs on the GPU machine (not committed)
cd /tmp
B="python3 -m probex.bench_engine --tokenizer-dir /root/skeleton --runner v2"
X="--extra-arg=--attention-backend FLASH_ATTN"
$B "$X" --setups plain,tap --out /root/dA > /root/dA.log 2>&1
$B "$X" --setups tap --worker-env PROBEX_SWITCH_INTERVAL_S=0.0005 --out /root/dB > /root/dB.log 2>&1
$B "$X" --setups tap --worker-env PROBEX_SCORE_WAIT_S=0 --out /root/dC > /root/dC.log 2>&1
$B "$X" --setups plain --out /root/dD > /root/dD.log 2>&1
touch /root/diag.done
