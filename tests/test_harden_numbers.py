"""Issue 11, findings 7 and 9: absurd numbers are refused in one line (exit 2) before they reach
MLX or numpy: config values, options, sizes, nesting, a prompt that is not UTF-8, an op argument."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hardening import (
    TINY_CONFIG,
    assert_invalid,
    assert_one_line_refusal,
    build_tiny,
    cli,
    edit_plan,
)

PLANS = Path(__file__).parent.parent / "plans"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("harden-numbers")
    return build_tiny(root / "tiny"), root / "tiny"


def _config(tmp_path: Path, **changes) -> Path:
    config = {**TINY_CONFIG, **changes}
    for key, value in list(config.items()):
        if value is ...:
            del config[key]
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return path


@pytest.mark.parametrize(
    ("changes", "needle"),
    [
        ({"hidden_size": 0}, "hidden_size must be between 1"),
        ({"intermediate_size": 0}, "intermediate_size must be between 1"),
        ({"vocab_size": 0}, "vocab_size must be between 1"),
        ({"vocab_size": -5}, "vocab_size must be between 1"),
        ({"vocab_size": 10**10}, "vocab_size must be between 1"),
        ({"quantization": {"bits": 0, "group_size": 64}}, "bits must be one of"),
        ({"quantization": {"bits": "x", "group_size": 64}}, "bits must be one of"),
        ({"quantization": {"bits": 4}}, "group_size must be one of"),
        ({"num_hidden_layers": 10**6}, "num_hidden_layers must be between 1 and 512"),
        ({"num_hidden_layers": 2000}, "at most that many layers"),
        ({"rms_norm_eps": -1.0}, "rms_norm_eps must be a positive number"),
    ],
)
@pytest.mark.parametrize("command", ["compile", "fit"])
def test_absurd_config_values(tmp_path, command, changes, needle):
    config = _config(tmp_path, **changes)
    argv = (["compile", str(config), "-N", "8", "-M", "4", "-o", "-"] if command == "compile"
            else ["fit", str(config), "--memory", "1GiB", "-M", "4"])  # fmt: skip
    result = cli(*argv)
    line = assert_one_line_refusal(result, command, needle)
    assert "not supported yet" not in line


@pytest.mark.parametrize(
    ("text", "needle"),
    [('"rope_theta": 1' + "0" * 400, "an integer of 401 digits"),
     ('"hidden_size": ' + "9" * 5000, "not valid JSON")],
    ids=["400 digits", "5000 digits"],
)
def test_numbers_of_hundreds_of_digits_in_a_config(tmp_path, text, needle):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY_CONFIG)[:-1] + ", " + text + "}")
    for argv in (["compile", str(path), "-N", "8", "-M", "4", "-o", "-"],
                 ["fit", str(path), "--memory", "1GiB", "-M", "4"]):  # fmt: skip
        assert_one_line_refusal(cli(*argv), argv[0], needle)


def test_deeply_nested_config(tmp_path):
    path = tmp_path / "config.json"
    path.write_text('{"model_type": "qwen2", "x": ' + "[" * 100000 + "]" * 100000 + "}")
    assert_one_line_refusal(cli("compile", str(path), "-N", "8", "-M", "4", "-o", "-"), "compile",
                            "nested")
    path.write_text(json.dumps({**TINY_CONFIG, "x": [[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[1]]]]]]]]]]
                                                                 ]]]]]]]]]]]]]]]]]]]]]]]]}))  # fmt: skip
    assert_one_line_refusal(cli("compile", str(path), "-N", "8", "-M", "4", "-o", "-"), "compile",
                            "nests")


@pytest.mark.parametrize(
    ("option", "value", "needle"),
    [
        ("-N", str(10**12), "input tokens (-N) must be at most"),
        ("-N", str(2**31), "input tokens (-N) must be at most"),
        ("-M", str(10**12), "output tokens (-M) must be at most"),
        ("--prefill-chunk", str(10**9), "prefill chunk must be at most"),
        ("--alignment", str(2**60), "alignment must be at most"),
        ("--memory", "9" * 400, "size out of range"),
        ("--batch", "-1", "batch must be at least 1"),
    ],
)
def test_absurd_compile_options(tmp_path, option, value, needle):
    config = _config(tmp_path)
    argv = ["compile", str(config), "-N", "8", "-M", "4", "-o", "-", option, value]
    assert_one_line_refusal(cli(*argv), "compile", needle)


def test_sizes_of_four_hundred_nines():
    nines = "9" * 400
    old = str(PLANS / "qwen1.5b.plan")
    assert_one_line_refusal(cli("diff", old, old, "--budget", nines), "diff", "out of range")
    assert_one_line_refusal(cli("diff", old, old, "--fail-above", nines), "diff", "--fail-above")
    assert_one_line_refusal(
        cli("fit", str(PLANS / "configs" / "qwen2.5-1.5b-instruct-4bit.json"), "--memory", nines,
            "-M", "4"), "fit", "out of range")  # fmt: skip


def test_a_prompt_that_is_not_utf8(tiny):
    plan, folder = tiny
    prompt = b"caf\xe9".decode("utf-8", "surrogateescape")  # how Python passes such argv
    result = cli("run", str(plan), "--model", str(folder), "--prompt", prompt)
    assert_one_line_refusal(result, "run", "not valid UTF-8")


def test_a_nested_prompts_file(tiny, tmp_path):
    plan, folder = tiny
    prompts = tmp_path / "prompts.json"
    prompts.write_text("[" * 100000 + "]" * 100000)
    result = cli("bench", str(plan), "--model", str(folder), "--prompts", str(prompts), "-q",
                 "--out", str(tmp_path / "out"))  # fmt: skip
    assert_one_line_refusal(result, "bench", "nested")


def test_a_broadcast_argument_of_ten_to_the_twelve(tiny, tmp_path):
    plan, folder = tiny

    def edit(doc: dict) -> None:
        decode = next(p for p in doc["phases"] if p["name"] == "decode")
        op = next(o for o in decode["ops"] if o["primitive"] == "Broadcast")
        op["args"] = [[10**12] * len(op["args"][0])]

    edited = edit_plan(plan, tmp_path / "broadcast.plan", edit)
    assert_invalid(cli("validate", str(edited)), "1000000000000", "32-bit")
    run = cli("run", str(edited), "--model", str(folder), "--tokens", "1,2")
    assert_one_line_refusal(run, "run", "1000000000000")


def test_an_mlx_error_is_one_line(tiny, tmp_path):
    """Arguments MLX itself rejects come back as nanobind's multi-line text: joined into one."""
    from dctms.cli.main import one_line

    assert one_line("first\n  second\n\nthird") == "first; second; third"


def test_a_number_of_5000_digits_in_a_safetensors_header(tiny, tmp_path):
    import shutil
    import struct

    plan, folder = tiny
    model = tmp_path / "model"
    shutil.copytree(folder, model)
    weights = model / "model.safetensors"
    raw = weights.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = raw[8 : 8 + n].replace(b'"data_offsets":[', b'"data_offsets":[' + b"9" * 5000 + b",", 1)
    assert len(header) > n
    weights.write_bytes(struct.pack("<Q", len(header)) + header + raw[8 + n :])
    for argv in (["compile", str(model), "-N", "8", "-M", "4", "-o", "-"],
                 ["run", str(plan), "--model", str(model), "--tokens", "1"]):  # fmt: skip
        assert_one_line_refusal(cli(*argv), argv[0], "not a safetensors file")
