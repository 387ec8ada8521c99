import numpy as np
import pytest
import yaml

from probes.artifact import (
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
    ],
)
def test_bad_metadata_is_refused(tmp_path, edit, message):
    path = make_probe(tmp_path)
    meta = yaml.safe_load((path / "probe.yaml").read_text())
    edit(meta)
    (path / "probe.yaml").write_text(yaml.safe_dump(meta))
    with pytest.raises(ProbeFormatError, match=message):
        load_probe(path)


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
