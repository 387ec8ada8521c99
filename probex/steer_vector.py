"""`probex steer-vector`: a steering vector as the difference of means of two prompt sets.

Activations come through the serving tap's capture mode (`probex extract`), so the vector
is built from exactly the residual stream the steering op will write to: the stream
after decoder block L. Per prompt, one activation is taken (the last prompt token — the
chat template's final token, where the model decides how to answer — or the mean over
the prompt's tokens), then

    v = mean(positive activations) - mean(negative activations)

written as a steering-vector artifact (docs/steering.md). The vector keeps its natural
scale (its norm is recorded), so alpha = 1 adds exactly the mean difference.

    probex steer-vector --layer 18 --positive harmful.txt --negative harmless.txt --name refusal --out vec/
    probex steer-vector --worker http://127.0.0.1:8100 --capture-dir DIR --layer 18 ...   # a running worker
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np

from probes.steering import SteeringVector, difference_of_means, save_vector

READS = ("last_prompt_token", "prompt_mean")


def add_steer_vector_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--layer", required=True, type=int, help="decoder layer whose output the vector is for")
    parser.add_argument("--positive", required=True, type=Path, help="prompts to steer towards (.txt or .jsonl)")
    parser.add_argument("--negative", required=True, type=Path, help="prompts to steer away from (.txt or .jsonl)")
    parser.add_argument("--name", required=True, help="the vector's name (requests select it by this)")
    parser.add_argument("--out", required=True, type=Path, help="artifact directory to write")
    parser.add_argument("--read", choices=READS, default="last_prompt_token",
                        help="which activation of each prompt enters the means")
    parser.add_argument("--model", default="smollm2-135m-instruct", help="model to start a worker with")
    parser.add_argument("--worker", default=None, help="use a running worker started with --capture-dir")
    parser.add_argument("--capture-dir", default=None, type=Path, help="that worker's --capture-dir")
    parser.add_argument("--admin-token", default=None,
                        help="that worker's admin token, which capture needs (default: $PROBEX_ADMIN_TOKEN)")
    parser.add_argument("--dtype", default="float32", help="engine dtype when a worker is started here")


def prompt_activations(acts_dir: Path, layer: int, read: str) -> np.ndarray:
    """[prompts, hidden]: one activation per prompt extracted into `acts_dir` (its index order)."""
    from safetensors.numpy import load_file

    from probex.extract import INDEX

    rows = []
    for line in (acts_dir / INDEX).read_text().splitlines():
        entry = json.loads(line)
        tensors = load_file(str(acts_dir / entry["file"]))
        key = f"layer_{layer}"
        if key not in tensors:
            raise SystemExit(f"probex steer-vector: {acts_dir / entry['file']} holds no {key}: the worker does not"
                             f" tap layer {layer} (start it with --layer {layer})")
        acts = tensors[key]
        rows.append(acts[-1] if read == "last_prompt_token" else acts.mean(axis=0))
    return np.stack(rows)


def build_vector(positive: list[str], negative: list[str], worker_url: str, capture_dir: Path, model: str,
                 layer: int, read: str, name: str, admin_token: str | None = None) -> SteeringVector:
    from probex.extract import extract

    with tempfile.TemporaryDirectory(prefix="probex-steer-") as tmp:
        sets = {}
        for label, prompts in (("positive", positive), ("negative", negative)):
            out = Path(tmp) / label
            extract(prompts, out, worker_url, capture_dir, model, admin_token)
            sets[label] = prompt_activations(out, layer, read)
    vector = difference_of_means(sets["positive"], sets["negative"])
    return SteeringVector(
        name=name, layer=layer, vector=vector, model={"name": Path(model).name},
        extra={"method": {"kind": "difference_of_means", "read": read, "positive_prompts": len(positive),
                          "negative_prompts": len(negative), "norm": float(np.linalg.norm(vector))}},
    )


def worker_model(worker: str) -> str:
    import httpx

    try:
        r = httpx.get(worker + "/v1/models", timeout=10)
        r.raise_for_status()
        return r.json()["data"][0]["id"]
    except (httpx.HTTPError, httpx.InvalidURL) as exc:
        raise SystemExit(f"probex steer-vector: could not reach the worker at {worker}"
                         f" ({str(exc) or type(exc).__name__})") from None
    except (ValueError, LookupError, TypeError):
        raise SystemExit(f"probex steer-vector: {worker}/v1/models did not list a model:"
                         f" is {worker} a probex worker?") from None


def run_steer_vector(args: argparse.Namespace) -> None:
    from probes.datasets import DatasetError, load_prompts
    from probex.extract import capture_worker, worker_token

    # load_vector refuses a blank name: refuse it before the worker starts, not after.
    if not args.name.strip():
        raise SystemExit("probex steer-vector: --name is blank; give the vector a name")
    try:
        positive, negative = load_prompts(args.positive), load_prompts(args.negative)
    except DatasetError as exc:
        raise SystemExit(f"probex steer-vector: {exc}") from None
    if args.worker:
        if not args.capture_dir:
            raise SystemExit("probex steer-vector: --worker needs --capture-dir (the worker's own)")
        worker = args.worker.rstrip("/")
        model = worker_model(worker)
        vector = build_vector(positive, negative, worker, args.capture_dir, model, args.layer, args.read, args.name,
                              worker_token(args))
    else:
        with capture_worker(args.model, [args.layer], args.dtype, "probex steer-vector") as (url, capture, model,
                                                                                           token):
            vector = build_vector(positive, negative, url, capture, model, args.layer, args.read, args.name, token)
    save_vector(vector, args.out)
    print(f"wrote steering vector {vector.name!r} (layer {vector.layer}, norm {np.linalg.norm(vector.vector):.3f},"
          f" {len(positive)} positive / {len(negative)} negative prompts) to {args.out}")
