"""Ordinary bad input to the probex commands: a one-line `probex <cmd>: ...` refusal, never a traceback.

Each refusal is also checked to come before the slow part (model loading, extraction): the
model directories here are fakes that hold only a config.json, so reaching the slow part
would fail with some other error than the one asserted.
"""

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from probes.datasets import DatasetError, load_prompts, load_user_file
from probex.cli import main

DEMO_PROBE = Path(__file__).resolve().parent.parent / "config" / "probes" / "harmful-request"
CLOSED = "http://127.0.0.1:1"  # nothing listens on port 1


def refusal(argv: list[str]) -> str:
    """The message of the SystemExit `probex argv` ends with (any other exception fails the test)."""
    with pytest.raises(SystemExit) as info:
        main(argv)
    message = info.value.code
    assert isinstance(message, str), f"exit {message!r}: expected a message"
    assert message.startswith(f"probex {argv[0]}: "), message
    assert "\n" not in message, message
    return message


@pytest.fixture
def fake_model(tmp_path):
    """A directory with SmolLM2-135M's shape and no weights: enough for every check made up front."""
    model = tmp_path / "fake-model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"hidden_size": 576, "num_hidden_layers": 30}))
    return model


@pytest.fixture
def labelled(tmp_path):
    path = tmp_path / "ok.jsonl"
    path.write_text("".join(json.dumps({"text": f"prompt {i}", "label": i % 2}) + "\n" for i in range(40)))
    return path


# --------------------------------------------------------------------------- dataset files


def test_latin1_datasets_are_refused_naming_file_and_line(tmp_path):
    jsonl = tmp_path / "latin1.jsonl"
    jsonl.write_bytes('{"text": "ok", "label": 0}\n{"text": "caf\u00e9", "label": 1}\n'.encode("latin-1"))
    with pytest.raises(DatasetError, match=r"latin1\.jsonl:2: not UTF-8"):
        load_user_file(jsonl)
    csv_file = tmp_path / "latin1.csv"
    csv_file.write_bytes("text,label\ncaf\u00e9,1\n".encode("latin-1"))
    with pytest.raises(DatasetError, match=r"latin1\.csv:2: not UTF-8"):
        load_user_file(csv_file)
    txt = tmp_path / "latin1.txt"
    txt.write_bytes("caf\u00e9\n".encode("latin-1"))
    with pytest.raises(DatasetError, match=r"latin1\.txt:1: not UTF-8"):
        load_prompts(txt)


def test_csv_with_a_long_prompt_and_an_excel_bom_loads(tmp_path):
    long_prompt = "word " * 40_000  # 200 kB: past csv's default 128 KiB field limit
    path = tmp_path / "long.csv"
    path.write_text(f'text,label\n"{long_prompt}",1\nshort,0\n', encoding="utf-8-sig")
    examples = load_user_file(path)
    assert [(len(e.text), e.label) for e in examples] == [(len(long_prompt.strip()), 1), (5, 0)]
    bom_jsonl = tmp_path / "bom.jsonl"
    bom_jsonl.write_text(json.dumps({"text": "hi", "label": 0}) + "\n", encoding="utf-8-sig")
    assert [e.text for e in load_user_file(bom_jsonl)] == ["hi"]
    import csv

    assert csv.field_size_limit() == 131072  # the process-wide limit is left as it was


def test_malformed_csv_and_jsonl_are_dataset_errors(tmp_path, monkeypatch):
    from probes import datasets

    monkeypatch.setattr(datasets, "CSV_FIELD_LIMIT", 1000)  # a field past it, without writing 16 MiB
    big = tmp_path / "big.csv"
    big.write_text(f"text,label\nok,0\n{'a' * 2000},1\n")
    with pytest.raises(DatasetError, match=r"big\.csv:3: not valid CSV \(field larger than field limit"):
        load_user_file(big)
    digits = tmp_path / "digits.jsonl"
    digits.write_text('{"text": "a", "label": ' + "1" * 5000 + "}\n")  # int() refuses this many digits
    with pytest.raises(DatasetError, match=r"digits\.jsonl:1: not valid JSON"):
        load_user_file(digits)


def test_train_reports_bad_dataset_files(tmp_path, fake_model):
    latin1 = tmp_path / "latin1.csv"
    latin1.write_bytes("text,label\ncaf\u00e9,1\n".encode("latin-1"))
    message = refusal(["train", "--model", str(fake_model), "--layer", "4", "--dataset", str(latin1),
                       "--out", str(tmp_path / "p")])
    assert "latin1.csv:2: not UTF-8" in message


def test_steer_vector_reports_bad_prompt_files(tmp_path):
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("caf\u00e9\n".encode("latin-1"))
    ok = tmp_path / "ok.txt"
    ok.write_text("hello\n")
    base = ["steer-vector", "--layer", "4", "--name", "v", "--out", str(tmp_path / "v"), "--model", "/nonexistent"]
    assert "latin1.txt:1: not UTF-8" in refusal(base + ["--positive", str(latin1), "--negative", str(ok)])
    empty = tmp_path / "empty.txt"
    empty.write_text("\n \n")
    assert "empty.txt: no prompts" in refusal(base + ["--positive", str(ok), "--negative", str(empty)])
    assert "--name is blank" in refusal(["steer-vector", "--layer", "4", "--name", " ", "--out", str(tmp_path / "v"),
                                         "--positive", str(ok), "--negative", str(ok)])
    message = refusal(base + ["--positive", str(ok), "--negative", str(ok), "--worker", CLOSED,
                              "--capture-dir", str(tmp_path)])
    assert f"could not reach the worker at {CLOSED}" in message


def test_prompt_files_keep_text_as_extract_reads_it(tmp_path):
    txt = tmp_path / "p.txt"
    txt.write_text("  indented prompt\n\nsecond\n")
    assert load_prompts(txt) == ["  indented prompt", "second"]
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text('{"text": "a"}\n{"label": 1}\n')
    with pytest.raises(DatasetError, match=r"p\.jsonl:2: .*'text'"):
        load_prompts(jsonl)


def test_extract_reports_bad_prompt_files_in_one_line(tmp_path):
    # Read before any worker is started or reached (the worker address here is closed).
    base = ["extract", "--out", str(tmp_path / "acts"), "--layer", "1", "--worker", CLOSED,
            "--capture-dir", str(tmp_path)]
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("caf\u00e9\n".encode("latin-1"))
    assert "latin1.txt:1: not UTF-8" in refusal(base + ["--prompts", str(latin1)])
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text('{"text": "a"}\n{"label": 1}\n')
    assert "p.jsonl:2:" in refusal(base + ["--prompts", str(jsonl)])
    empty = tmp_path / "empty.txt"
    empty.write_text("\n \n")
    assert "empty.txt: no prompts" in refusal(base + ["--prompts", str(empty)])
    assert "not found" in refusal(base + ["--prompts", str(tmp_path / "missing.txt")])


# --------------------------------------------------------------------------- probex train


def test_train_refuses_a_blank_name_before_loading_the_model(tmp_path, labelled):
    # The model does not exist: a refusal about the name shows the name is checked first.
    message = refusal(["train", "--model", "/nonexistent-model", "--dataset", str(labelled), "--name", "  ",
                       "--out", str(tmp_path / "p")])
    assert "--name is blank" in message
    message = refusal(["train", "--model", "/nonexistent-model", "--dataset", str(labelled), "--out", "/"])
    assert "--out / gives no probe name" in message


def test_train_names_the_probe_after_the_resolved_out_directory(tmp_path, monkeypatch):
    from probex.train_cli import probe_name

    here = tmp_path / "my-probe"
    here.mkdir()
    monkeypatch.chdir(here)
    assert probe_name(argparse.Namespace(name=None, out=Path("."))) == "my-probe"
    assert probe_name(argparse.Namespace(name="given", out=Path("."))) == "given"


def test_train_refuses_a_directory_that_is_not_a_model(tmp_path, labelled):
    message = refusal(["train", "--model", str(tmp_path), "--dataset", str(labelled), "--out", str(tmp_path / "p")])
    assert f"{tmp_path} is not a model directory" in message and "config.json" in message


# --------------------------------------------------------------------------- probex calibrate / eval


def test_calibrate_refuses_a_missing_probe(fake_model):
    message = refusal(["calibrate", "--model", str(fake_model), "--probe", "/nonexistent"])
    assert "/nonexistent: probe directory not found" in message


def test_calibrate_refuses_an_unknown_eval_split_before_extraction(fake_model):
    # With the fake model, any extraction would fail on the missing weights instead.
    message = refusal(["calibrate", "--model", str(fake_model), "--probe", str(DEMO_PROBE), "--eval-split", "nosuch"])
    assert "records no split 'nosuch'" in message and "held_out" in message


def test_eval_refuses_a_missing_probe(fake_model, tmp_path):
    message = refusal(["eval", "--probe", "/nonexistent", "--worker", CLOSED, "--model-dir", str(fake_model),
                       "--out", str(tmp_path / "e.json")])
    assert "/nonexistent: probe directory not found" in message


def test_eval_refuses_an_unreachable_worker_before_extraction(fake_model, tmp_path):
    message = refusal(["eval", "--probe", str(DEMO_PROBE), "--worker", CLOSED, "--split", "test",
                       "--model-dir", str(fake_model), "--out", str(tmp_path / "e.json")])
    assert f"could not reach the worker at {CLOSED}" in message


def test_eval_that_cannot_write_its_out_prints_the_report_and_ends_in_one_line(fake_model, tmp_path, monkeypatch,
                                                                                capsys):
    from probex import eval_served

    # the comparison itself (minutes of served and offline scoring) stands in here
    monkeypatch.setattr(eval_served, "compare", lambda *a, **k: {"splits": {}, "_scores": {}})
    blocker = tmp_path / "file"
    blocker.write_text("")
    message = refusal(["eval", "--probe", str(DEMO_PROBE), "--worker", CLOSED, "--model-dir", str(fake_model),
                       "--out", str(blocker / "e.json")])
    assert f"cannot write {blocker / 'e.json'}" in message
    assert '"splits"' in capsys.readouterr().out  # the report is not lost with the file


# --------------------------------------------------------------------------- policy-schema and the plumbing


def test_policy_schema_refuses_an_unwritable_path(tmp_path):
    message = refusal(["policy-schema", "--out", str(tmp_path / "no" / "such" / "dir" / "x.json")])
    assert "cannot write" in message


def test_user_errors_a_command_does_not_catch_end_in_one_line(monkeypatch, tmp_path):
    from probex import calibrate

    def raises(error):
        def run(args):
            raise error
        return run

    monkeypatch.setattr(calibrate, "run_calibrate", raises(DatasetError("x.jsonl:3: broken")))
    assert refusal(["calibrate", "--probe", "p"]) == "probex calibrate: x.jsonl:3: broken"
    # Anything else is a bug and keeps its traceback.
    monkeypatch.setattr(calibrate, "run_calibrate", raises(ValueError("a bug")))
    with pytest.raises(ValueError, match="a bug"):
        main(["calibrate", "--probe", "p"])


def test_the_probex_command_exits_nonzero_without_a_traceback(tmp_path, fake_model):
    result = subprocess.run([sys.executable, "-m", "probex.cli", "calibrate", "--model", str(fake_model),
                             "--probe", str(tmp_path / "nope")],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().startswith("probex calibrate: ") and "probe directory not found" in result.stderr
