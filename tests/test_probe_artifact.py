from pathlib import Path

import numpy as np
import pytest
import yaml

from probes.artifact import (
    Features,
    ProbeArtifact,
    ProbeFormatError,
    ProbeMismatchError,
    ReadPoint,
    ServedModel,
    check_probe_set,
    load_probe,
    save_probe,
)

SERVED = ServedModel(hidden_size=8, num_hidden_layers=4)


def make_probe(tmp_path, name="p", layer=2, hidden=8, weight=None, read=ReadPoint.LAST_PROMPT_TOKEN):
    w = np.arange(hidden, dtype=np.float32) if weight is None else weight
    probe = ProbeArtifact(name=name, layer=layer, read=read, weight=w, bias=0.5, slope=2.0, intercept=-1.0)
    return save_probe(probe, tmp_path / name)


def test_round_trip_keeps_every_field(tmp_path):
    path = make_probe(tmp_path, read=ReadPoint.PROMPT_MAX)
    probe = load_probe(path, SERVED)
    assert probe.name == "p" and probe.layer == 2 and probe.read is ReadPoint.PROMPT_MAX
    assert probe.bias == 0.5 and probe.slope == 2.0 and probe.intercept == -1.0
    np.testing.assert_array_equal(probe.weight, np.arange(8, dtype=np.float32))
    assert probe.raw_score(np.ones(8)) == pytest.approx(28.5)


def test_wrong_hidden_size_is_refused_naming_the_file(tmp_path):
    path = make_probe(tmp_path, hidden=6)
    with pytest.raises(ProbeMismatchError, match=r"hidden_size 6 .* hidden_size 8") as err:
        load_probe(path, SERVED)
    assert str(path) in str(err.value)


def test_layer_out_of_range_is_refused(tmp_path):
    path = make_probe(tmp_path, layer=4)
    with pytest.raises(ProbeMismatchError, match=r"layer 4, out of range .* 4 decoder layers"):
        load_probe(path, SERVED)


def test_nan_weights_are_refused(tmp_path):
    w = np.ones(8, dtype=np.float32)
    w[3] = np.nan
    path = make_probe(tmp_path, weight=w)
    with pytest.raises(ProbeFormatError, match=r"1 non-finite values"):
        load_probe(path)


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda m: m.pop("layer"), "required field 'layer'"),
        (lambda m: m.update(read="middle"), "read 'middle' is not one of"),
        (lambda m: m.update(layer="two"), "'layer' must be an integer"),
        (lambda m: m.update(calibration={"slope": "x"}), "calibration.slope must be a finite number"),
        (lambda m: m.update(hidden_size=9), "says hidden_size 9 but 'weight' has 8"),
        # YAML reads 1 followed by 400 zeros as an int beyond float's range (was an OverflowError)
        (lambda m: m.update(calibration={"slope": 10**400}), "calibration.slope must be a finite number"),
        (lambda m: m.update(calibration={"intercept": -10**400}), "calibration.intercept must be a finite number"),
    ],
)
def test_bad_metadata_is_refused(tmp_path, edit, message):
    path = make_probe(tmp_path)
    meta = yaml.safe_load((path / "probe.yaml").read_text())
    edit(meta)
    (path / "probe.yaml").write_text(yaml.safe_dump(meta))
    with pytest.raises(ProbeFormatError, match=message):
        load_probe(path)


# What `probex train` writes (probex/train_cli.py) and the demo artifact under config/ holds.
VALID_RETENTION = {"reference_cosine": 0.377447, "layer": 2, "features": "last prompt token",
                   "set": ["temaq-abliterated==1.1.1:harmful_probes.txt#4", "probex:benign_hard_negatives.txt#27"]}


def write_meta(path, **fields):
    meta = yaml.safe_load((path / "probe.yaml").read_text())
    meta.update(fields)
    (path / "probe.yaml").write_text(yaml.safe_dump(meta))
    return path


@pytest.mark.parametrize(
    "retention, message",
    [
        ("oops", "field 'retention' must be a mapping, got 'oops'"),
        (None, "field 'retention' must be a mapping, got None"),
        ({**VALID_RETENTION, "set": "abc"}, r"retention.set must be a list of prompt refs"),
        ({**VALID_RETENTION, "set": ["pkg:f.txt#1", 7]}, r"retention.set: 7 is not a prompt ref"),
        ({**VALID_RETENTION, "set": ["pkg:f.txt"]}, r"retention.set: 'pkg:f.txt' is not a prompt ref"),
        ({**VALID_RETENTION, "set": ["pkg:f.txt#abc"]}, r"retention.set: 'pkg:f.txt#abc' is not a prompt ref"),
        ({**VALID_RETENTION, "reference_cosine": 0}, r"retention.reference_cosine must be a non-zero finite number, got 0"),
        ({**VALID_RETENTION, "reference_cosine": "high"}, r"retention.reference_cosine must be .* got 'high'"),
        ({**VALID_RETENTION, "reference_cosine": float("nan")}, r"retention.reference_cosine must be .* got nan"),
        ({**VALID_RETENTION, "reference_cosine": 10**400}, r"retention.reference_cosine must be a non-zero finite"),
        ({**VALID_RETENTION, "reference_cosine": True}, r"retention.reference_cosine must be .* got True"),
        ({**VALID_RETENTION, "layer": 3}, r"retention.layer must be the probe's layer 2, got 3"),
        ({**VALID_RETENTION, "features": "first token"}, r"retention.features 'first token' is not one of"),
        ({**VALID_RETENTION, "features": "mean of all prompt rows"},
         r"retention.features 'mean of all prompt rows' contradicts read 'last_prompt_token'"),
    ],
)
def test_malformed_retention_fields_are_refused_naming_the_field(tmp_path, retention, message):
    """The worker computes retention after every swap: a bad field must fail the load, named,
    not crash the check later (AttributeError, ZeroDivisionError, ValueError deep in expand_rows)."""
    path = write_meta(make_probe(tmp_path), retention=retention)
    with pytest.raises(ProbeFormatError, match=message) as err:
        load_probe(path)
    assert str(path / "probe.yaml") in str(err.value)


def test_mean_features_must_agree_with_the_read_span(tmp_path):
    path = make_probe(tmp_path, read=ReadPoint.PROMPT_MEAN)
    write_meta(path, read_span="user_message", retention={**VALID_RETENTION, "features": "mean of all prompt rows"})
    with pytest.raises(ProbeFormatError, match="contradicts read 'prompt_mean' and read_span 'user_message'"):
        load_probe(path)
    write_meta(path, read_span="everything", retention=VALID_RETENTION)
    with pytest.raises(ProbeFormatError, match="read_span must be 'user_message'"):
        load_probe(path)


def test_features_are_those_recorded_else_those_the_read_implies(tmp_path):
    """`probex train --read prompt_mean` fits on every prompt row, probes.demo on the user's message
    (`read_span: user_message`): retention must re-measure on the same vectors."""
    path = write_meta(make_probe(tmp_path), retention=VALID_RETENTION)
    assert load_probe(path).features is Features.LAST_PROMPT_TOKEN
    mean = make_probe(tmp_path, name="m", read=ReadPoint.PROMPT_MEAN)
    assert load_probe(mean).features is Features.ALL_ROWS_MEAN
    write_meta(mean, read_span="user_message")
    assert load_probe(mean).features is Features.USER_MESSAGE_MEAN
    write_meta(mean, retention={**VALID_RETENTION, "features": "user-message mean"})
    assert load_probe(mean).features is Features.USER_MESSAGE_MEAN
    # What the project ships still loads, and so does a reference above 1 (tests/test_observability.py
    # scales the demo's by 10 to raise the calibration alarm) and a user file's name holding a "#".
    demo = load_probe(Path(__file__).resolve().parent.parent / "config" / "probes" / "harmful-request")
    assert demo.features is Features.LAST_PROMPT_TOKEN
    write_meta(path, retention={**VALID_RETENTION, "reference_cosine": 3.77, "set": ["file:a#b.jsonl#3"]})
    assert load_probe(path).extra["retention"]["reference_cosine"] == 3.77


def test_missing_files_are_named(tmp_path):
    path = make_probe(tmp_path)
    (path / "probe.safetensors").unlink()
    with pytest.raises(ProbeFormatError, match="probe.safetensors: missing"):
        load_probe(path)
    with pytest.raises(ProbeFormatError, match="probe directory not found"):
        load_probe(tmp_path / "nope")


def test_unreadable_paths_and_non_utf8_metadata_are_refused_as_format_errors(tmp_path):
    """What the system refuses to read is the artifact's fault, named, not an OSError or a
    UnicodeDecodeError out of the loader (a live swap answered those with a 500)."""
    with pytest.raises(ProbeFormatError, match="cannot read this probe directory"):
        load_probe(tmp_path / ("a" * 5000))  # a name longer than the file system allows
    path = make_probe(tmp_path)
    (path / "probe.yaml").write_bytes((path / "probe.yaml").read_bytes() + b"note: caf\xe9\n")
    with pytest.raises(ProbeFormatError, match="probe.yaml: not UTF-8 text"):
        load_probe(path)


def test_corrupt_weights_file_is_refused(tmp_path):
    path = make_probe(tmp_path)
    (path / "probe.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ProbeFormatError, match="cannot read safetensors"):
        load_probe(path)


def test_duplicate_names_in_a_set_are_refused(tmp_path):
    a = load_probe(make_probe(tmp_path / "a", name="same"))
    b = load_probe(make_probe(tmp_path / "b", name="same"))
    with pytest.raises(ProbeFormatError, match="two probes are named 'same'"):
        check_probe_set([a, b])


def test_probe_metadata_parsing_does_not_import_torch():
    import subprocess
    import sys

    code = "import sys, probes; probes.load_probe; assert 'torch' not in sys.modules and 'vllm' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
