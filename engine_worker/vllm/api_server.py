"""ProbeX's middleware as vLLM's API server loads it (`--middleware`).

The engine-agnostic middleware (engine_worker/api_server/middleware.py) with vLLM's two
answers: the engine's workers are reached through the API server's public
`engine_client.collective_rpc`, and a client that did not ask for token ids has vLLM leave
the prompt's ids out of the first chunk (openai.py).
"""

from __future__ import annotations

from engine_worker.api_server.middleware import ProbexMiddleware
from engine_worker.vllm.openai import PROMPT_TOKEN_IDS_UNWANTED, leave_out_unwanted_prompt_token_ids


class _PromptIdsLeftOut:
    def __enter__(self):
        self._token = PROMPT_TOKEN_IDS_UNWANTED.set(True)

    def __exit__(self, *exc) -> None:
        PROMPT_TOKEN_IDS_UNWANTED.reset(self._token)


class VllmMiddleware(ProbexMiddleware):
    def __init__(self, app, hub=None, tap_config=None) -> None:
        super().__init__(app, hub, tap_config)
        if self.hub is not None:
            leave_out_unwanted_prompt_token_ids()

    async def engine_rpc(self, app, method: str, *args) -> list[dict]:
        return await app.state.engine_client.collective_rpc(method, args=args)

    def prompt_ids_left_out(self):
        return _PromptIdsLeftOut()
