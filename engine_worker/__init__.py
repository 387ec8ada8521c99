"""ProbeX engine worker: an in-graph probe tap for LLM serving engines and per-request score delivery.

The data path, device to response:

    decoder layer L --torch.ops.probex.tap (tap/ops.py, tap/kernel.py)--> static score buffers
      --the engine thread enqueues device copies into the score ring (tap/ring_copies.py)-->
    score formatter process (scores/formatter.py: books, calibrates, writes JSON)
      --ZMQ, one topic per API server process--> hub (api_server/hub.py)
      --> middleware relays (api_server/relay.py) attach `probex` to bodies and stream chunks

Packages, by job:
- step.py        the typed per-step view an engine adapter hands the core (`StepView`)
- settings.py    the environment variables the worker reads
- steering.py    per-request steering settings (probex_steer* xargs), windows, cache salt
- tap/           the op and its kernel, the static buffers of tapped and steered layers, the
                 controller (probe sets, steering vectors, per-step hand-off), the ring copies
- scores/        the step wire format, the score ring, the score formatter, bookkeeping,
                 rendering (no torch, no engine)
- api_server/    the ASGI middleware in the engine's API server: request checks, relays, hub,
                 retention, admin routes
- vllm/          the only code that imports vLLM: plugin, runner adapters, decoder-layer
                 patches, OpenAI-server patches, `probex worker`
"""
