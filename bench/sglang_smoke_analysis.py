"""The SGLang GPU smoke's parts that need no engine: models and the HF reference, served
responses read back as raw probe scores, the comparisons with their tolerances, and the
runner that keeps going past a failed check. bench/sglang_smoke.py drives the engines;
tests/test_sglang_smoke.py checks these on the CPU.

Scores are compared raw (w·h + b): a response's calibrated scores are turned back with the
probe's slope and intercept (the smoke's probes: 1 and 0), so the tolerances read the same
for every probe.
"""

from __future__ import annotations

import argparse
import math
import shutil
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

# fp32 parity: |served - HF| <= FP32_REL * max(|HF|, the RMS of HF's values for that probe)
FP32_REL = 1e-3
# fp32 parity: every captured prompt row's cosine to HF hidden_states[L + 1]
FP32_COSINE = 0.9999
# bf16 parity ("within bf16 rounding"): the served scores' largest distance from HF in fp32 on
# the same bf16 weights is at most this many times HF's own bf16 distance from it
BF16_NOISE_FACTOR = 4.0
# two served runs of one model (modes, alone vs concurrent): |difference| <= this times the
# standard deviation of the probe's scores in the comparison. In bf16, HF's own bf16 scores of
# the smoke's Llama differ from its fp32 ones by up to 0.17 of that spread (layer 20); a row
# off by one differs by about 1.4 of it.
MODE_TOL = {"bfloat16": 0.3, "float32": 1e-3}

ARCHS = ("llama", "qwen2")
DTYPES = ("float32", "bfloat16")  # saved in this order: the bf16 copy is cast from the fp32 one


# -- models and the HF reference ----------------------------------------------------------------

def model_config(skeleton: Path, arch: str):
    """The skeleton's Llama config, or a Qwen2 config of the same shape."""
    from transformers import LlamaConfig, Qwen2Config

    base = LlamaConfig.from_pretrained(skeleton)
    if arch == "llama":
        return base
    rope = dict(getattr(base, "rope_parameters", None) or {"rope_type": "default", "rope_theta": 10000.0})
    return Qwen2Config(
        vocab_size=base.vocab_size, hidden_size=base.hidden_size, intermediate_size=base.intermediate_size,
        num_hidden_layers=base.num_hidden_layers, num_attention_heads=base.num_attention_heads,
        num_key_value_heads=base.num_key_value_heads, max_position_embeddings=base.max_position_embeddings,
        rms_norm_eps=base.rms_norm_eps, tie_word_embeddings=base.tie_word_embeddings, rope_parameters=rope,
        bos_token_id=base.bos_token_id, eos_token_id=base.eos_token_id, pad_token_id=base.pad_token_id)


def build_models(skeleton: Path, work: Path, archs: Sequence[str] = ARCHS) -> dict[tuple[str, str], Path]:
    """Random-init models of the skeleton's shape, each saved in fp32 and in bf16 (the same
    weights, rounded), with the skeleton's tokenizer files: {(arch, dtype): directory}."""
    out = {}
    for arch in archs:
        dirs = {dtype: work / f"{arch}-{dtype}" for dtype in DTYPES}
        if not all((d / "config.json").exists() for d in dirs.values()):
            import torch
            from transformers import LlamaForCausalLM, Qwen2ForCausalLM

            torch.manual_seed(0)
            model = (LlamaForCausalLM if arch == "llama" else Qwen2ForCausalLM)(model_config(skeleton, arch)).float()
            with torch.no_grad():
                for name, parameter in model.named_parameters():
                    if name.endswith(".bias"):  # Qwen2's q/k/v biases start at zero
                        parameter.normal_(0.0, 0.02)
            for dtype, directory in dirs.items():
                model.to(getattr(torch, dtype)).save_pretrained(directory)
                for f in skeleton.iterdir():
                    if f.is_file() and f.name != "config.json":
                        shutil.copy(f, directory / f.name)
        out.update({(arch, dtype): d for dtype, d in dirs.items()})
    return out


def chat_prompt_ids(tokenizer, prompt: str) -> list[int]:
    """The ids SGLang 0.5.14 serves for a one-message chat (serving_chat: the template rendered
    as text, then encoded without specials where encoding "" already adds some)."""
    messages = [{"role": "user", "content": prompt}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    extra = {"add_special_tokens": False} if len(tokenizer.encode("")) > 0 else {}
    return list(tokenizer.encode(text, **extra))


class Reference:
    """transformers on a saved model, on the CPU, computing in `compute_dtype`."""

    def __init__(self, model_dir: Path, compute_dtype: str = "float32") -> None:
        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, compute_dtype)).eval()

    def rows(self, ids: Sequence[int], layers: Sequence[int]) -> dict[int, np.ndarray]:
        """hidden_states[L + 1] (the residual after decoder layer L) for each L, float64 [tokens, hidden]."""
        with self.torch.no_grad():
            out = self.model(self.torch.tensor([list(ids)]), output_hidden_states=True)
        return {layer: out.hidden_states[layer + 1][0].double().numpy() for layer in layers}


def reference_scores(rows: dict[int, np.ndarray], probes, prompt_len: int, generated: int) -> dict[str, dict]:
    """Raw scores HF gives: the prompt's last, mean and max, and each generated token's at the
    row that sampled it (position prompt_len - 1 + j)."""
    out = {}
    for probe in probes:
        raw = probe.raw_score(rows[probe.layer])
        prompt = raw[:prompt_len]
        out[probe.name] = {"last": float(prompt[-1]), "mean": float(prompt.mean()), "max": float(prompt.max()),
                           "generated": raw[prompt_len - 1: prompt_len - 1 + generated].tolist()}
    return out


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


# -- served responses as raw scores -------------------------------------------------------------

def raw_of(score: float | None, slope: float = 1.0, intercept: float = 0.0) -> float:
    """The raw score behind a calibrated one (sigmoid(slope * raw + intercept)); NaN if none."""
    if score is None or not 0.0 < score < 1.0:
        return float("nan")
    return (math.log(score) - math.log1p(-score) - intercept) / slope


def _prompt_part(prompt: dict, probe) -> dict:
    return {"last": prompt["last_raw"], "mean": raw_of(prompt["mean"], probe.slope, probe.intercept),
            "max": raw_of(prompt["max"], probe.slope, probe.intercept),
            "tokens_scored": prompt["tokens_scored"], "prompt_tokens": prompt["prompt_tokens"]}


def served_scores(response: dict, probes) -> dict[str, dict]:
    """A whole response's `probex` scores, raw, per probe it carries."""
    scores = response["probex"]["scores"]
    out = {}
    for probe in probes:
        if probe.name in scores:
            entry = scores[probe.name]
            generated = (entry.get("generated") or {}).get("scores") or []
            out[probe.name] = {**_prompt_part(entry["prompt"], probe),
                               "generated": [raw_of(s, probe.slope, probe.intercept) for s in generated]}
    return out


def output_ids(response: dict) -> list[int]:
    """The generated ids of a chat response asked with `logprobs` and `return_meta_info`
    (SGLang's `output_token_logprobs`: (logprob, id, text) per token)."""
    return [int(entry[1]) for entry in response["choices"][0]["meta_info"]["output_token_logprobs"]]


def record_of(response: dict, probes) -> dict:
    return {"tokens": output_ids(response), "scores": served_scores(response, probes),
            "usage": response.get("usage") or {}}


def stream_record(chunks: list[dict], probes) -> tuple[dict, dict]:
    """A stream's chunks (parsed `data:` events, without [DONE]) as a record (tokens are the
    logprobs' token texts) and its count check: every chunk's generated scores continue at the
    offset reached, a chunk with usage carries as many as its new tokens, and the totals equal
    the final completion_tokens."""
    names = {p.name: p for p in probes}
    problems: list[str] = []
    prompt: dict[str, dict] = {}
    generated: dict[str, list[float]] = {n: [] for n in names}
    tokens: list[str] = []
    counted = 0  # completion tokens reported by usage so far
    final_usage = None
    for i, chunk in enumerate(chunks):
        if "error" in chunk:
            problems.append(f"chunk {i}: error {str(chunk['error'])[:200]}")
            continue
        usage = chunk.get("usage")
        choices = chunk.get("choices") or []
        if usage is not None and not choices:
            final_usage = usage
        for choice in choices:
            tokens += [c["token"] for c in ((choice.get("logprobs") or {}).get("content") or [])]
        new = None
        if usage is not None and choices:
            new, counted = int(usage["completion_tokens"]) - counted, int(usage["completion_tokens"])
        scores = (chunk.get("probex") or {}).get("scores") or {}
        lengths = set()
        for name, entry in scores.items():
            if name not in names:
                continue
            if "prompt" in entry and name not in prompt:
                prompt[name] = _prompt_part(entry["prompt"], names[name])
            part = entry.get("generated")
            if part is None:
                continue
            if part.get("offset", len(generated[name])) != len(generated[name]):
                problems.append(f"chunk {i}: {name} offset {part.get('offset')} after {len(generated[name])} scores")
            probe = names[name]
            generated[name] += [raw_of(s, probe.slope, probe.intercept) for s in part["scores"]]
            lengths.add(len(part["scores"]))
        if new is not None and lengths - {new}:
            problems.append(f"chunk {i}: {sorted(lengths)} scores for {new} new tokens")
        if new and not lengths:
            problems.append(f"chunk {i}: {new} new tokens without scores")
    total = int(final_usage["completion_tokens"]) if final_usage else None
    if total is None:
        problems.append("no closing usage chunk")
    for name, values in generated.items():
        if total is not None and len(values) != total:
            problems.append(f"{name}: {len(values)} generated scores for {total} tokens")
    record = {"tokens": tokens, "scores": {n: {**prompt.get(n, {}), "generated": generated[n]} for n in names},
              "usage": final_usage or {}}
    return record, {"ok": not problems, "tokens": total, "problems": problems[:10]}


# -- comparisons --------------------------------------------------------------------------------

def parity_rows(served: dict, expected32: dict, expected16: dict | None = None) -> tuple[list[dict], list[str]]:
    """One row per compared value (probe, what, served, HF fp32 [, HF bf16]) and the problems
    that make a comparison impossible (a missing probe, a count that differs)."""
    rows, problems = [], []
    for name, want in expected32.items():
        got = served.get(name)
        if got is None:
            problems.append(f"{name}: no scores served")
            continue
        other = (expected16 or {}).get(name)
        for what in ("last", "mean", "max"):
            rows.append({"probe": name, "what": what, "served": got[what], "hf": want[what],
                         "hf_bf16": other[what] if other else None})
        if len(got["generated"]) != len(want["generated"]):
            problems.append(f"{name}: {len(got['generated'])} generated scores for {len(want['generated'])} tokens")
        for j, (s, h) in enumerate(zip(got["generated"], want["generated"])):
            rows.append({"probe": name, "what": f"generated {j}", "served": s, "hf": h,
                         "hf_bf16": other["generated"][j] if other else None})
    return rows, problems


def own_row_closest(served: Sequence[float], expected: Sequence[float]) -> tuple[int, int]:
    """(generated scores closer to their own row's HF value than to a neighbour's, those with a neighbour)."""
    closest = compared = 0
    for j, s in enumerate(served[:len(expected)]):
        others = [abs(s - expected[k]) for k in (j - 1, j + 1) if 0 <= k < len(expected)]
        if others:
            compared += 1
            closest += abs(s - expected[j]) < min(others)
    return closest, compared


def parity_summary(rows: list[dict], dtype: str, problems: Sequence[str] = (),
                   row_cosines: Sequence[float] = ()) -> dict:
    """Judge a model's served scores against HF (module constants say how, per dtype)."""
    out: dict[str, Any] = {"compared": len(rows), "problems": list(problems)[:20]}
    if not rows:
        return {**out, "pass": False}
    by_probe: dict[str, list[dict]] = {}
    for row in rows:
        by_probe.setdefault(row["probe"], []).append(row)
    worst_rel, worst_abs, noise, floor = 0.0, 0.0, 0.0, 0.0
    worst_row = None
    for name, probe_rows in by_probe.items():
        rms = math.sqrt(sum(r["hf"] ** 2 for r in probe_rows) / len(probe_rows))
        floor = max(floor, FP32_REL * rms)
        for r in probe_rows:
            diff = abs(r["served"] - r["hf"]) if not math.isnan(r["served"]) else math.inf
            rel = diff / max(abs(r["hf"]), rms, 1e-30)
            if rel > worst_rel:
                worst_rel, worst_row = rel, {k: r[k] for k in ("probe", "what", "served", "hf")}
            worst_abs = max(worst_abs, diff)
            if r.get("hf_bf16") is not None:
                noise = max(noise, abs(r["hf_bf16"] - r["hf"]))
    out.update({"max_abs_diff": worst_abs, "max_rel_diff": worst_rel, "worst": worst_row})
    if dtype == "float32":
        ok = worst_rel <= FP32_REL
        out["tolerance"] = f"relative {FP32_REL}"
    else:
        allowed = BF16_NOISE_FACTOR * noise + floor
        ok = worst_abs <= allowed
        out.update({"hf_bf16_max_abs_diff": noise, "allowed_abs": allowed,
                    "tolerance": f"{BF16_NOISE_FACTOR} x HF bf16's own distance from HF fp32"})
    if row_cosines:
        out["residual_cos_min"] = float(min(row_cosines))
        out["residual_rows"] = len(row_cosines)
        if dtype == "float32":
            ok = ok and out["residual_cos_min"] >= FP32_COSINE
    out["pass"] = bool(ok and not problems)
    return out


def _common_prefix(a: Sequence, b: Sequence) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def compare_records(first: Sequence[dict], second: Sequence[dict], dtype: str) -> dict:
    """Two served runs of the same requests, pairwise: the prompt's last score, its mean and max
    where both scored the same rows, and generated scores up to the first token where the
    sequences part (+1: token j's score depends only on tokens before it)."""
    diffs: dict[str, list[float]] = {}
    values: dict[str, list[float]] = {}
    worst = {"last": 0.0, "aggregate": 0.0, "generated": 0.0}
    same = compared = 0
    problems = []
    for index, (a, b) in enumerate(zip(first, second)):
        common = _common_prefix(a["tokens"], b["tokens"])
        same += list(a["tokens"]) == list(b["tokens"])
        for name, sa in a["scores"].items():
            sb = b["scores"].get(name)
            if sb is None or "last" not in sa or "last" not in sb:
                problems.append(f"request {index}: {name} missing")
                continue
            pairs = [("last", sa["last"], sb["last"])]
            if sa.get("tokens_scored") == sb.get("tokens_scored"):
                pairs += [("aggregate", sa[k], sb[k]) for k in ("mean", "max")]
            n = min(common + 1, len(sa["generated"]), len(sb["generated"]))
            compared += n
            pairs += [("generated", x, y) for x, y in zip(sa["generated"][:n], sb["generated"][:n])]
            for kind, x, y in pairs:
                d = abs(x - y) if not (math.isnan(x) or math.isnan(y)) else math.inf
                worst[kind] = max(worst[kind], d)
                diffs.setdefault(name, []).append(d)
                values.setdefault(name, []).append(x)
    ratio = 0.0
    for name, ds in diffs.items():
        spread = float(np.std(values[name])) or 1e-30
        ratio = max(ratio, max(ds) / spread)
    return {"requests": len(first), "identical_token_sequences": same, "compared_generated": compared,
            "last_abs": worst["last"], "aggregate_abs": worst["aggregate"], "generated_abs": worst["generated"],
            "max_diff_over_std": ratio, "tolerance_over_std": MODE_TOL[dtype], "problems": problems[:10],
            "pass": bool(ratio <= MODE_TOL[dtype] and not problems and len(first) == len(second))}


def graph_lines(log_text: str, patterns: dict[str, str]) -> dict[str, list[str]]:
    """The log's lines that match each pattern (substring), trimmed."""
    lines = log_text.splitlines()
    return {key: [l[-220:] for l in lines if pattern in l][:4] for key, pattern in patterns.items()}


# -- the runner ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class Check:
    name: str
    run: Callable[[Any], dict]
    engines: tuple = ()  # the engines it needs, in the order it starts them (for the time estimate)


def run_checks(checks: Sequence[Check], ctx: Any, budget_s: float | None = None,
               estimate: Callable[[Check], float] = lambda check: 0.0,
               record: Callable[[dict], None] = lambda results: None,
               clock: Callable[[], float] = time.monotonic, started: float | None = None) -> dict[str, dict]:
    """Run each check in turn; a failure is recorded with its traceback and the next runs. A
    check whose estimate would pass `budget_s` (seconds since `started`) is skipped. `record`
    gets the results after every check."""
    started = clock() if started is None else started
    results: dict[str, dict] = {}
    for check in checks:
        elapsed, need = clock() - started, estimate(check)
        if budget_s is not None and elapsed + need > budget_s:
            results[check.name] = {"status": "skipped", "reason": f"budget: {elapsed:.0f} s used, about"
                                   f" {need:.0f} s needed, {budget_s:.0f} s allowed"}
            record(results)
            continue
        begun = clock()
        try:
            out = check.run(ctx)
            results[check.name] = {"status": "pass" if out.get("pass") else "fail", **out}
        except Exception:
            results[check.name] = {"status": "error", "error": traceback.format_exc()[-4000:]}
        results[check.name]["seconds"] = round(clock() - begun, 1)
        record(results)
    return results


def parse_args(argv: Sequence[str] | None, check_names: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python3 -m bench.sglang_smoke",
                                     description="GPU smoke of `probex worker --engine sglang`")
    parser.add_argument("--skeleton", type=Path, help="config.json + tokenizer files (docs/gpu.md)")
    parser.add_argument("--out", type=Path, help="sglang_smoke.json and the worker logs")
    parser.add_argument("--report", type=Path, metavar="JSON", help="print a saved sglang_smoke.json's table and stop")
    parser.add_argument("--work", type=Path, default=Path("/tmp/probex-sglang-smoke"), help="models and probes")
    parser.add_argument("--checks", default=",".join(check_names),
                        help=f"comma-separated subset, run in this order: {','.join(check_names)}")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="start no check that would end more than this many seconds after the start")
    parser.add_argument("--chunked-prefill-size", type=int, default=64)
    parser.add_argument("--start-timeout-s", type=float, default=480)
    parser.add_argument("--extra-arg", action="append", default=[], metavar="ARG",
                        help="passed to every worker (repeatable; --extra-arg=--flag for dashes)")
    args = parser.parse_args(argv)
    if args.report is None and not (args.skeleton and args.out):
        parser.error("--skeleton and --out are required unless --report is given")
    chosen = [c.strip() for c in args.checks.split(",") if c.strip()]
    unknown = [c for c in chosen if c not in check_names]
    if unknown or not chosen:
        parser.error(f"--checks: unknown {unknown or '(none given)'}; known: {', '.join(check_names)}")
    args.checks = chosen
    if args.chunked_prefill_size <= 0:
        parser.error("--chunked-prefill-size must be positive (the worker refuses unchunked prefill)")
    return args
