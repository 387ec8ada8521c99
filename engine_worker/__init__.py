"""ProbeX engine worker: an in-graph probe tap for vLLM plus per-request score delivery.

Module map (engine internals are touched only by the `vllm_*` modules):
- ops.py            torch.ops.probex.tap / .steer custom ops (graph-capturable; plain torch on CPU)
- fused_tap.py      the tap's arithmetic as one Triton kernel per layer and step, used by ops.py on CUDA
- tap.py            static buffers per tapped layer and the probe slots they hold
- steer.py          static buffers per steered layer: vector table, per-row alpha / vector / gate values
- steering.py       per-request steering settings (probex_steer* xargs), windows, cache salt (torch-free)
- tap_config.py     the tap configuration carried in vLLM's additional_config
- bookkeeping.py    rows of a step -> requests; per-request score accumulation (engine-agnostic)
- controller.py     loads probe sets and steering vectors, fills per-row steering values before each
                    forward, turns each step into score events, capture files
- score_transfer.py device->host copy of each step's scores off the engine thread (pinned buffers + event)
- delivery.py       score events from the worker process to the API server (ZMQ) and the hub there
- score_formatter.py a process beside the worker (the default; `--no-score-formatter`): books, calibrates and
                    writes each step's scores as JSON once, sending each API server process its own rows
- responses.py      attaching scores to OpenAI response bodies and stream chunks
- middleware.py     the ASGI middleware inside vLLM's API server (xargs checks, delivery, /probex routes)
- vllm_models.py    decoder-layer patches (Llama, Mistral, Qwen2) that call the op
- vllm_worker.py    vLLM glue shared by both runners: controller set-up, worker extension, recompute
- vllm_v1_runner.py the adapter for vLLM's V1 model runner (GPU and CPU): step layout, forward hook
- vllm_v2_runner.py the adapter for vLLM's model runner V2 (CUDA): step layout, forward hook
- plugin.py         the vllm.general_plugins entry point (registration only)
- launch.py         `probex worker`: validates probes, then starts vLLM's OpenAI server with all of the above
"""
