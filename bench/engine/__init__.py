"""Engine benchmark: what the in-graph tap costs a served model, next to plain vLLM and forced eager.

Set-ups are started one after the other (each a fresh server on a fresh port, stopped with all
its processes before the next; with ``--gpus 0,1`` side by side, one per GPU):

- ``plain``: stock vLLM's OpenAI server (CUDA graphs on where there is a GPU). ProbeX's
  ``vllm.general_plugins`` entry point is kept out with ``VLLM_PLUGINS`` naming no plugin.
- ``tap``: ``probex worker`` (same server, graphs on) with 8 probes, 4 at each of two layers,
  mixed read points.
- ``tap-toggle``: the tap measured within one start: at each concurrency, phases with the tap
  running and paused (``PUT /probex/tap``: its kernels return at once, nothing is delivered)
  in the order running, paused, paused, running (``--toggle-pairs`` of each; beginning paused
  in every second tap-toggle start, ``--toggle-first``), fresh prompts each. The running phases
  over the paused ones give the tap's cost without the spread between starts; then
  ``--idle-pairs`` pairs of single requests to the idle engine, the tap running for one of each
  pair and paused for the other.
- ``eager``: plain with ``--enforce-eager``: what a hook-based tool forces the engine into.
- ``steer-idle``: tap plus one steering vector loaded (``--steer-vector``, a random unit
  direction) at ``--steer-layer``; no request asks for steering.
- ``steer-active``: the same worker, every request steered through ``vllm_xargs``; afterwards
  two prompts unsteered and steered check that the probes after the write see it.
- ``steer-gated``: as steer-active, gated by the first probe at the earlier probe layer.

Load: every phase at every concurrency (default 1, 8, 64) is one run of vLLM's own load
client, ``vllm bench serve`` (bench/vllm_bench.py): random-token prompts of ``--input-len``,
``--output-len`` tokens each with ``ignore_eos``, at most c requests in flight, the same seed
and so the same prompts for every set-up, after a warm-up call on prompts of its own. Its
saved results (TTFT, TPOT, ITL mean/p50/p99, output tokens/s) are what the tables read. The
bench's own small client (client.py) does only what that client cannot: reading the
``probex`` scores of a worker's requests token by token (``scores`` in the JSON: every
generated token scored by every probe), the steering check's prompt scores, and tap-toggle's
idle pairs, whose tap is switched between two single requests on one start.

The model is a real architecture with ``--load-format dummy`` (timings do not depend on weight
values): ``--model-config llama-3.1-8b`` writes Llama-3.1-8B's config.json next to the tokenizer
files of ``--tokenizer-dir`` (SmolLM2's by default).

    # GPU machine, from the repository root:
    python3 -m bench.engine --tokenizer-dir TOK --out "$OUT" --setups plain,tap,tap-toggle,eager
    # here: the CPU smoke mode (what `make test` runs), and re-rendering a saved run
    .venv/bin/python -m bench.engine --smoke
    .venv/bin/python -m bench.engine --reanalyze run1/bench_engine.json [run2/...] --png chart.png

Writes ``OUT/bench_engine.json`` (after every phase, so a run cut short keeps what it
measured), ``OUT/<label>.log`` per server, ``OUT/vllm-bench/<label>/`` (each phase's
``vllm bench serve`` result and log), ``OUT/bench_engine_tpot.png`` when matplotlib is
importable, and prints the markdown tables, ending with the run held against the tap's goals.
"""
