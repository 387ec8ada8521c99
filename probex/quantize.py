"""`probex quantize`: a fake-quantized copy of a model (weights quantized, then de-quantized).

Round-to-nearest, symmetric, per output channel and per group of `group_size` input
columns (group size 0 = one scale per whole output row; -1 = one scale per matrix, the
crudest). Only the decoder's
linear layers are quantized (attention and MLP projections); embeddings, norms and the
head stay as they are. The result is a normal HF directory that vLLM serves unchanged,
so the retention check can be run on "what a quantized deployment computes".

    probex quantize --model smollm2-135m-instruct --method int4-rtn --group-size 0 --out /tmp/smollm2-int4-row
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

METHODS = {"int8-rtn": 8, "int4-rtn": 4}
LINEAR_SUFFIXES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def add_quantize_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--method", required=True, choices=sorted(METHODS))
    parser.add_argument("--group-size", type=int, default=64,
                        help="input columns per scale; 0 = one per row; -1 = one per matrix")
    parser.add_argument("--out", required=True, type=Path)


def fake_quantize(weight, bits: int, group_size: int):
    """Symmetric RTN per (row, group); returns the de-quantized weight in the input dtype."""
    import torch

    w = weight.float()
    rows, cols = w.shape
    if group_size < 0:  # one scale for the whole matrix
        w = w.reshape(1, rows * cols)
        return fake_quantize(w, bits, 0).reshape(rows, cols).to(weight.dtype)
    group = cols if group_size == 0 else group_size
    if cols % group:
        raise SystemExit(f"probex quantize: group size {group} does not divide {cols} input columns")
    grouped = w.reshape(rows, cols // group, group)
    qmax = 2 ** (bits - 1) - 1
    scale = grouped.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / qmax
    q = torch.clamp(torch.round(grouped / scale), -qmax - 1, qmax)
    return (q * scale).reshape(rows, cols).to(weight.dtype)


def quantize_model(model_dir: Path, method: str, group_size: int, out: Path) -> dict:
    import torch
    from safetensors.torch import load_file, save_file

    bits = METHODS[method]
    out.mkdir(parents=True, exist_ok=True)
    for f in model_dir.iterdir():
        if f.suffix != ".safetensors" and f.is_file():
            shutil.copy(f, out / f.name)
    quantized = 0
    error = torch.zeros((), dtype=torch.float64)
    norm = torch.zeros((), dtype=torch.float64)
    for shard in sorted(model_dir.glob("*.safetensors")):
        tensors = load_file(str(shard))
        for name, tensor in tensors.items():
            if tensor.ndim == 2 and name.rsplit(".", 2)[-2] in LINEAR_SUFFIXES:
                new = fake_quantize(tensor, bits, group_size)
                error += (new.double() - tensor.double()).pow(2).sum()
                norm += tensor.double().pow(2).sum()
                tensors[name] = new.contiguous()
                quantized += 1
        save_file(tensors, str(out / shard.name), metadata={"format": "pt"})
    summary = {"method": method, "group_size": group_size, "linear_layers_quantized": quantized,
               "relative_weight_error": float((error / norm).sqrt())}
    (out / "probex-quantization.json").write_text(__import__("json").dumps(summary, indent=1))
    return summary


def run_quantize(args: argparse.Namespace) -> None:
    from engine_worker.vllm.launch import resolve_model

    summary = quantize_model(resolve_model(args.model), args.method, args.group_size, args.out)
    print(summary)
