"""Reference activation extraction with Hugging Face transformers (float32, CPU is fine).

What the served engine sees, reproduced offline:
- each prompt is sent as one user message with no system message, and rendered with the
  tokenizer's chat template and `add_generation_prompt=True`, exactly like vLLM's chat
  endpoint; SmolLM2's template then inserts its default system prompt;
- the rendered text is tokenized without adding special tokens (the template has them);
- probe layer L reads HF `hidden_states[L + 1]` (index 0 is the embedding output), which
  equals the residual stream after vLLM decoder block L (see docs/probe-format.md).

What is kept per prompt and layer:
- `last`: the last prompt token's vector (what `last_prompt_token` reads);
- `user_mean`: the mean over the tokens of the user's message only. The chat template's
  tokens (a default system prompt of ~20 tokens on SmolLM2) are identical for every
  prompt and would dominate a mean over all prompt tokens;
- `all_mean`: the mean over every templated prompt token, kept only to measure how much
  including the template costs (it is what an engine averaging all prompt rows computes);
- `user_tokens`: every user-message token's vector, for `prompt_max` (the max of w·x+b
  depends on w, so it cannot be precomputed). Stored as float16 when the values fit,
  which halves disk and memory; a max readout is insensitive to ~1e-3 relative error.

torch and transformers are imported inside the functions that need them, so importing
this module (for `LayerActivations`) stays cheap and engine-free.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from probes.atomic_files import replacing
from probes.datasets import cache_root

# Bump when what a cache file holds or how it is computed changes: old files are then ignored.
CACHE_FORMAT = 1
_PLACEHOLDER = "\x00PROBEX-USER-MESSAGE\x00"
_FLOAT16_LIMIT = 60000.0  # float16 tops out at 65504; keep a margin


class ExtractionError(ValueError):
    """Extraction cannot proceed (bad layer, a prompt with no user tokens, ...)."""


# --------------------------------------------------------------------------- results


@dataclass
class LayerActivations:
    """One layer's activations for N prompts, in the order the prompts were given."""

    layer: int
    last: np.ndarray  # [N, H] float32
    user_mean: np.ndarray  # [N, H] float32
    all_mean: np.ndarray  # [N, H] float32
    user_tokens: np.ndarray  # [T, H] all prompts' user tokens stacked (float16 or float32)
    offsets: np.ndarray  # [N] int64: prompt i's tokens are user_tokens[offsets[i]:offsets[i+1]]

    @property
    def num_prompts(self) -> int:
        return int(self.last.shape[0])

    def subset(self, index: np.ndarray) -> "LayerActivations":
        """The same layer for prompts `index` (in that order)."""
        index = np.asarray(index, dtype=np.int64)
        stops = np.append(self.offsets[1:], self.user_tokens.shape[0])
        pieces = [self.user_tokens[self.offsets[i] : stops[i]] for i in index]
        lengths = np.array([len(p) for p in pieces], dtype=np.int64)
        offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64) if len(index) else lengths
        tokens = np.concatenate(pieces) if pieces else self.user_tokens[:0]
        return LayerActivations(self.layer, self.last[index], self.user_mean[index], self.all_mean[index], tokens, offsets)

    def max_of_raw(self, weight: np.ndarray, bias: float) -> np.ndarray:
        """Per prompt, max over its user tokens of w·x + b (the `prompt_max` raw score)."""
        raw = self.user_tokens.astype(np.float32) @ weight.astype(np.float32)
        return np.maximum.reduceat(raw, self.offsets).astype(np.float64) + bias


# --------------------------------------------------------------------------- templating


@dataclass(frozen=True)
class TemplatedPrompt:
    text: str  # the rendered chat prompt
    input_ids: list[int]
    user_start: int  # first token of the user's message (token index)
    user_stop: int  # one past its last token

    @property
    def key(self) -> str:
        """Cache key of the prompt: the rendered text and its tokens, so a new template or tokenizer misses."""
        payload = json.dumps([CACHE_FORMAT, self.text, self.input_ids])
        return hashlib.sha256(payload.encode()).hexdigest()


def chat_messages(user_text: str) -> list[dict[str, str]]:
    # One user turn and no system message: what a plain chat request to the gateway sends.
    return [{"role": "user", "content": user_text}]


def template_prompt(tokenizer: Any, user_text: str) -> TemplatedPrompt:
    """Render one prompt as vLLM's chat endpoint does and locate the user's message tokens."""
    rendered = tokenizer.apply_chat_template(chat_messages(user_text), tokenize=False, add_generation_prompt=True)
    # Find where the message sits in the rendered text by rendering a placeholder in its
    # place: the template's own text around it is the same, whatever the template says.
    marked = tokenizer.apply_chat_template(chat_messages(_PLACEHOLDER), tokenize=False, add_generation_prompt=True)
    prefix, _, suffix = marked.partition(_PLACEHOLDER)
    if prefix + user_text + suffix == rendered:
        char_start = len(prefix)
    else:
        # The template changed the message (e.g. trimmed it); fall back to its last occurrence.
        char_start = rendered.rfind(user_text.strip())
        if char_start < 0:
            raise ExtractionError(f"cannot find the user message in the rendered chat prompt: {user_text[:60]!r}")
        user_text = user_text.strip()
    char_stop = char_start + len(user_text)

    encoding = tokenizer(rendered, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = list(encoding["input_ids"]), encoding["offset_mapping"]
    # A token belongs to the message if its characters overlap the message's characters
    # (a token such as "\n " that straddles the boundary counts as the message's).
    inside = [i for i, (a, b) in enumerate(offsets) if b > char_start and a < char_stop]
    if not inside:
        raise ExtractionError(f"the user message has no tokens of its own: {user_text[:60]!r}")
    return TemplatedPrompt(rendered, ids, inside[0], inside[-1] + 1)


# --------------------------------------------------------------------------- cache


def model_cache_key(model_dir: Path) -> str:
    """Name + a fingerprint of config, tokenizer and weight files (size and mtime, not content: fast)."""
    h = hashlib.sha256()
    for path in sorted(model_dir.iterdir()):
        if path.is_file():
            stat = path.stat()
            h.update(f"{path.name}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    return f"{model_dir.name}-{h.hexdigest()[:12]}"


def activations_dir() -> Path:
    return cache_root() / "activations"


def _cache_path(model_key: str, layer: int, prompt_key: str) -> Path:
    return activations_dir() / model_key / f"layer-{layer:02d}" / prompt_key[:2] / f"{prompt_key}.npz"


def _save(path: Path, last: np.ndarray, user_mean: np.ndarray, all_mean: np.ndarray, user_tokens: np.ndarray) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if np.abs(user_tokens).max() < _FLOAT16_LIMIT:
        user_tokens = user_tokens.astype(np.float16)
    # Atomic: a crash never leaves a half-written cache entry, nor two processes extracting
    # the same prompt (a worker's retention check, an offline evaluation) a broken one.
    with replacing(path, suffix=".npz") as side:
        np.savez(side, last=last, user_mean=user_mean, all_mean=all_mean, user_tokens=user_tokens)


# --------------------------------------------------------------------------- extraction


def _load_model(model_dir: Path, dtype: str = "float32") -> Any:
    import torch
    from transformers import AutoModel

    # AutoModel gives the decoder without the LM head: we only need hidden states, and the
    # head is a 49k x 576 matmul per token for nothing.
    return AutoModel.from_pretrained(str(model_dir), dtype=getattr(torch, dtype)).eval()


def _num_layers(model_dir: Path) -> int:
    config = json.loads((model_dir / "config.json").read_text())
    return int(config.get("text_config", config)["num_hidden_layers"])


def check_layers(layers: Sequence[int], num_layers: int) -> None:
    for layer in layers:
        # HF's last hidden_states entry has the final norm applied, so it is not the
        # residual stream the engine taps after the last block: refuse it rather than
        # train a probe on the wrong quantity.
        if not 0 <= layer < num_layers - 1:
            raise ExtractionError(
                f"layer {layer}: the HF reference path reads layers 0..{num_layers - 2} of this"
                f" {num_layers}-layer model (hidden_states[-1] is post-norm)"
            )


def _batches(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Group prompt indices (sorted by length, so padding is small) into batches of <= max_tokens padded tokens."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    batches: list[list[int]] = []
    current: list[int] = []
    for i in order:
        if current and lengths[i] * (len(current) + 1) > max_tokens:
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    return batches


def _run_batches(model: Any, prompts: Sequence[TemplatedPrompt], layers: Sequence[int], model_key: str,
                 pad_id: int, max_tokens: int, show_progress: bool) -> None:
    """Forward the prompts in length-sorted batches and write every (layer, prompt) cache entry."""
    import torch
    from tqdm import tqdm

    batches = _batches([len(p.input_ids) for p in prompts], max_tokens)
    bar = tqdm(total=len(prompts), desc="HF activations", unit="prompt", disable=not show_progress)
    with torch.inference_mode():
        for batch in batches:
            width = max(len(prompts[i].input_ids) for i in batch)
            ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for row, i in enumerate(batch):
                n = len(prompts[i].input_ids)
                # Right padding keeps every real token at its true position; under causal
                # attention the pads after it cannot change it.
                ids[row, :n] = torch.tensor(prompts[i].input_ids)
                mask[row, :n] = 1
            hidden = model(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states
            for layer in layers:
                states = hidden[layer + 1].float().numpy()
                for row, i in enumerate(batch):
                    p, n = prompts[i], len(prompts[i].input_ids)
                    tokens = states[row, :n]
                    user = tokens[p.user_start : p.user_stop]
                    _save(
                        _cache_path(model_key, layer, p.key),
                        last=tokens[n - 1].copy(),
                        user_mean=user.mean(axis=0),
                        all_mean=tokens.mean(axis=0),
                        user_tokens=user.copy(),
                    )
            bar.update(len(batch))
    bar.close()


def extract_activations(
    texts: Sequence[str],
    model_dir: str | Path,
    layers: Sequence[int],
    *,
    max_batch_tokens: int = 4096,
    show_progress: bool = True,
    dtype: str = "float32",
) -> dict[int, LayerActivations]:
    """Activations of `texts` (user messages) at probe layers `layers`, computed once and cached on disk.

    Returns {layer: LayerActivations} with prompts in the order of `texts`.
    """
    from transformers import AutoTokenizer

    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():
        raise ExtractionError(f"{model_dir}: not a Hugging Face model directory (config.json missing)")
    if not texts:
        raise ExtractionError("no prompts to extract")
    layers = sorted(set(int(l) for l in layers))
    check_layers(layers, _num_layers(model_dir))

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    prompts = [template_prompt(tokenizer, t) for t in texts]
    model_key = model_cache_key(model_dir) + ("" if dtype == "float32" else f"-{dtype}")

    # Forward only prompts that miss some layer; identical prompts are run once.
    unique = {p.key: p for p in prompts}
    todo = [p for p in unique.values() if not all(_cache_path(model_key, l, p.key).is_file() for l in layers)]
    if todo:
        model = _load_model(model_dir, dtype)
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        _run_batches(model, todo, layers, model_key, pad_id, max_batch_tokens, show_progress)

    return {layer: _assemble(layer, [_cache_path(model_key, layer, p.key) for p in prompts]) for layer in layers}


def _assemble(layer: int, paths: Sequence[Path]) -> LayerActivations:
    last, user_mean, all_mean, tokens = [], [], [], []
    for path in paths:
        with np.load(path) as data:
            last.append(data["last"])
            user_mean.append(data["user_mean"])
            all_mean.append(data["all_mean"])
            tokens.append(data["user_tokens"])
    lengths = np.array([len(t) for t in tokens], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    # Keep float16 when every prompt stored it; one float32 file makes the stack float32.
    dtype = np.float16 if all(t.dtype == np.float16 for t in tokens) else np.float32
    return LayerActivations(
        layer=layer,
        last=np.stack(last).astype(np.float32),
        user_mean=np.stack(user_mean).astype(np.float32),
        all_mean=np.stack(all_mean).astype(np.float32),
        user_tokens=np.concatenate(tokens).astype(dtype),
        offsets=offsets,
    )
