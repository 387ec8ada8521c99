"""`probex extract`: residual-stream activations read through the serving tap.

Training on what serving reads: each prompt goes through a real `probex worker` in capture
mode (chat-templated exactly as the chat endpoint does, prefix cache bypassed so every
prompt row runs), and the rows the tap captured are collected into one safetensors file
per prompt plus an index. Reruns skip prompts already extracted (resumable).

    probex extract --model smollm2-135m-instruct --layer 18 --layer 22 --prompts prompts.txt --out acts/
    probex extract --worker http://127.0.0.1:8100 --capture-dir DIR ...   # a worker already running

Capture and recompute are engine controls: a worker takes them only with its admin token.
A worker started here gets a random one; a running worker's comes from --admin-token
(default $PROBEX_ADMIN_TOKEN).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import secrets
import shutil
import tempfile
from pathlib import Path

import httpx

from engine_worker.settings import ADMIN_TOKEN
from probex.processes import WorkerExited, wait_until_healthy

INDEX = "index.jsonl"


def add_extract_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompts", required=True, type=Path,
                        help="a .txt file (one prompt per line) or .jsonl with a 'text' field")
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--layer", action="append", type=int, default=[], help="layer to capture (repeatable)")
    parser.add_argument("--model", default="smollm2-135m-instruct", help="model to start a worker with")
    parser.add_argument("--worker", default=None, help="use a running worker started with --capture-dir")
    parser.add_argument("--capture-dir", default=None, type=Path, help="that worker's --capture-dir")
    parser.add_argument("--admin-token", default=None,
                        help="that worker's admin token, which capture needs (default: $PROBEX_ADMIN_TOKEN)")
    parser.add_argument("--dtype", default="float32", help="engine dtype when a worker is started here")


def worker_token(args: argparse.Namespace) -> str | None:
    """The admin token of the running worker `args.worker` names."""
    return getattr(args, "admin_token", None) or os.environ.get(ADMIN_TOKEN)


def control_headers(admin_token: str | None) -> dict[str, str]:
    """The headers that let a request carry engine controls (capture, recompute) to a worker."""
    return {"Authorization": f"Bearer {admin_token}"} if admin_token else {}


def read_prompts(path: Path) -> list[str]:
    """The prompts as `probes.datasets.load_prompts` reads them (the same texts, so the same
    activation keys, whichever command reads a file); a file it refuses ends the command with
    its one-line reason."""
    from probes.datasets import DatasetError, load_prompts

    if not path.is_file():
        raise SystemExit(f"probex extract: {path} not found")
    try:
        return load_prompts(path)
    except DatasetError as exc:
        raise SystemExit(f"probex extract: {exc}") from None


def prompt_key(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def extract(prompts: list[str], out: Path, worker_url: str, capture_dir: Path, model: str,
            admin_token: str | None = None) -> int:
    """Send every prompt not yet in out/index.jsonl; return how many were extracted now.
    `admin_token`: the worker's, sent with every request (capture is an engine control)."""
    from tqdm import tqdm

    out.mkdir(parents=True, exist_ok=True)
    index_path = out / INDEX
    done = set()
    if index_path.exists():
        done = {json.loads(line)["key"] for line in index_path.read_text().splitlines() if line.strip()}
    todo = [p for p in prompts if prompt_key(p) not in done]
    with httpx.Client(timeout=300, headers=control_headers(admin_token)) as client, index_path.open("a") as index:
        for text in tqdm(todo, desc="extract", unit="prompt"):
            body = {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 1,
                    "temperature": 0, "return_token_ids": True,
                    "vllm_xargs": {"probex_capture": True, "probex_recompute": True}}
            r = client.post(worker_url + "/v1/chat/completions", json=body)
            if r.status_code != 200:
                raise SystemExit(f"probex extract: worker answered {r.status_code}: {r.text[:300]}")
            response = r.json()
            found = sorted(capture_dir.glob(f"{response['id']}-*.safetensors"))
            if not found:
                raise SystemExit(f"probex extract: no capture file for {response['id']} in {capture_dir}"
                                 " (is the worker running with this --capture-dir?)")
            key = prompt_key(text)
            shutil.move(str(found[0]), out / f"{key}.safetensors")
            index.write(json.dumps({"key": key, "text": text, "prompt_token_ids": response["prompt_token_ids"],
                                    "file": f"{key}.safetensors"}) + "\n")
            index.flush()
    return len(todo)


def run_extract(args: argparse.Namespace) -> None:
    prompts = read_prompts(args.prompts)
    if args.worker:
        if not args.capture_dir:
            raise SystemExit("probex extract: --worker needs --capture-dir (the worker's own)")
        models = httpx.get(args.worker + "/v1/models", timeout=10).json()["data"]
        count = extract(prompts, args.out, args.worker, args.capture_dir, models[0]["id"], worker_token(args))
        print(f"extracted {count} prompts into {args.out}")
        return
    if not args.layer:
        raise SystemExit("probex extract: give at least one --layer")
    with capture_worker(args.model, args.layer, args.dtype, "probex extract") as (url, capture, model, token):
        count = extract(prompts, args.out, url, capture, model, token)
        print(f"extracted {count} prompts into {args.out}")


@contextlib.contextmanager
def capture_worker(model_name: str, layers: list[int], dtype: str, who: str, port: int = 8199):
    """A `probex worker` in capture mode tapping `layers`, for the duration of the block:
    (url, capture dir, model, its admin token: a random one, handed over in the environment)."""
    import subprocess
    import sys

    from engine_worker.vllm.launch import resolve_model

    model = str(resolve_model(model_name))
    capture = Path(tempfile.mkdtemp(prefix="probex-capture-"))
    cmd = [sys.executable, "-m", "probex.cli", "worker", "--model", model, "--port", str(port),
           "--capture-dir", str(capture), *[f"--layer={layer}" for layer in layers], "--dtype", dtype,
           "--gpu-memory-utilization", "0.25", "--max-model-len", "4096"]
    token = secrets.token_urlsafe(24)
    worker = subprocess.Popen(cmd, start_new_session=True, env={**os.environ, ADMIN_TOKEN: token})
    url = f"http://127.0.0.1:{port}"
    try:
        try:
            wait_until_healthy(worker, url)
        except WorkerExited as exc:
            raise SystemExit(f"{who}: {exc}") from None
        yield url, capture, model, token
    finally:
        worker.terminate()
        worker.wait(60)
        shutil.rmtree(capture, ignore_errors=True)
