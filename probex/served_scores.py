"""Prompt scores from a running `probex worker`: one chat request per prompt, `max_tokens: 1`,
the probe's part of the response's `probex` field read back.

The headline `score` is what a policy compares with its thresholds (calibrated, at the probe's
read point); `last_raw` is the raw score of the last prompt token; `prompt_tokens` counts the
rendered prompt.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
import numpy as np


def worker_failed(worker: str, exc: Exception, command: str = "eval") -> SystemExit:
    if isinstance(exc, httpx.HTTPStatusError):
        r = exc.response
        return SystemExit(f"probex {command}: the worker at {worker} answered {r.status_code} to"
                          f" {r.request.url.path}: {r.text[:200]!r}")
    return SystemExit(f"probex {command}: could not reach the worker at {worker} ({str(exc) or type(exc).__name__})")


def worker_model(client: httpx.Client, worker: str, command: str = "eval") -> str:
    """The id of the model the worker serves (what chat requests must name)."""
    try:
        r = client.get(worker + "/v1/models")
        r.raise_for_status()
        return r.json()["data"][0]["id"]
    except (httpx.HTTPError, httpx.InvalidURL) as exc:
        raise worker_failed(worker, exc, command) from None
    except (ValueError, LookupError, TypeError):
        raise SystemExit(f"probex {command}: {worker}/v1/models did not list a model:"
                         f" is {worker} a probex worker?") from None


@dataclass(frozen=True)
class ServedScores:
    score: np.ndarray  # calibrated headline score, what the policy compares
    last_raw: np.ndarray
    prompt_tokens: np.ndarray


def score_prompts(worker: str, texts: list[str], probe_name: str, *, command: str = "eval",
                  concurrency: int = 4, model: str | None = None, attempts: int = 3) -> ServedScores:
    """Each text's scores for `probe_name`, in order; a few requests in flight at once.

    A response without any scores (they came later than the worker waits for) is asked for
    again, up to `attempts` times; one whose scores lack the probe is refused at once.
    """
    worker = worker.rstrip("/")
    with httpx.Client(timeout=300, limits=httpx.Limits(max_connections=concurrency)) as client:
        model = model or worker_model(client, worker, command)

        def one(text: str) -> tuple[float, float, int]:
            for tries in range(1, attempts + 1):
                try:
                    r = client.post(worker + "/v1/chat/completions", json={
                        "model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 1,
                        "temperature": 0})
                    r.raise_for_status()
                    scores = r.json().get("probex", {}).get("scores") or {}
                except httpx.HTTPError as exc:
                    raise worker_failed(worker, exc, command) from None
                except (ValueError, AttributeError):
                    scores = {}
                if not scores:  # late scores: the response went out without them (PROBEX_SCORE_WAIT_S); ask again
                    continue
                try:
                    part = scores[probe_name]
                    return float(part["score"]), float(part["prompt"]["last_raw"]), int(part["prompt"]["prompt_tokens"])
                except (ValueError, LookupError, TypeError):
                    break
            raise SystemExit(f"probex {command}: {worker} returned no prompt score for probe {probe_name!r}"
                             f"{f' ({tries} tries)' if tries > 1 else ''}: is the worker serving this probe?")

        with ThreadPoolExecutor(max_workers=concurrency) as pool:
            rows = list(pool.map(one, texts))
    if not rows:
        return ServedScores(np.zeros(0), np.zeros(0), np.zeros(0, dtype=np.int64))
    score, raw, tokens = zip(*rows)
    return ServedScores(np.asarray(score), np.asarray(raw), np.asarray(tokens, dtype=np.int64))
