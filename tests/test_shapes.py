"""Shape files: the line format, the shipped Gemma 3 file, and files written from model configs."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tuner.shapes import DecoderShape, ShapeFileError, parse_shapes, write_shapes_from_config

ROOT = Path(__file__).resolve().parents[1]


def test_shipped_gemma3_file_has_every_model_projection_and_m():
    entries = parse_shapes("gemma3.txt")
    assert len(entries) == 4 * 4 * 6
    by_name = {}
    for e in entries:
        by_name.setdefault(e.name, set()).add((e.problem.n, e.problem.k))
        assert e.problem.layout == "tn" and e.problem.dtype_in == "bf16" and e.problem.groups == 1
    # Gemma 3 27B: hidden 5376, 32 heads / 16 KV heads of 128, MLP 21504.
    assert by_name["gemma3-27b.qkv"] == {(8192, 5376)}
    assert by_name["gemma3-27b.o"] == {(5376, 4096)}
    assert by_name["gemma3-27b.gate_up"] == {(43008, 5376)}
    assert by_name["gemma3-27b.down"] == {(5376, 21504)}
    # Gemma 3 1B: hidden 1152, 4 heads / 1 KV head of 256, MLP 6912.
    assert by_name["gemma3-1b.qkv"] == {(1536, 1152)}
    assert {e.problem.m for e in entries} == {1, 16, 128, 512, 2048, 8192}


def test_line_forms(tmp_path):
    f = tmp_path / "s.txt"
    f.write_text(
        "# comment\n\n"
        "1,64 4096 1024 name=dense  # trailing comment\n"
        "4096 2048 7168 groups=8 dtype=fp16 dtype_out=fp32 layout=nn\n"
        "1024 1024 1024,32768 name=mixed\n"
        "2560 2560 4096 held=20\n"
        "64 4096 1024\n"  # a duplicate of the first line's second key
    )
    entries = parse_shapes(f)
    assert [e.line for e in entries] == [3, 3, 4, 5, 6]
    dense, _, moe, mixed, held = (e.problem for e in entries)
    assert (dense.m, dense.n, dense.k, entries[0].name) == (1, 4096, 1024, "dense")
    assert (moe.groups, moe.dtype_in, moe.dtype_out, moe.layout) == (8, "fp16", "fp32", "nn")
    assert (mixed.groups, mixed.group_k, mixed.k) == (2, (1024, 32768), 32768)
    assert held.carveout == 20


@pytest.mark.parametrize("line, words", [
    ("4096 4096", "missing k"),
    ("1 2 3 4", "unexpected field"),
    ("16 4096 4096 colour=red", "unknown option"),
    ("16 4096 4096 layout=tt", "unknown layout"),
    ("16 4096 4096 dtype_out=int8", "unknown dtype_out"),
    ("16 4096 1024,2048 groups=3", "groups=3 but 2"),
    ("16,x 4096 4096", "m must be an integer"),
    ("16 4096 4096 groups=0", "groups must be positive"),
    ("16 4100 4096 layout=nn", "n=4100 must be a multiple of 8"),
])
def test_bad_lines_name_file_and_line(tmp_path, line, words):
    f = tmp_path / "bad.txt"
    f.write_text(f"16 1024 1024\n{line}\n")
    with pytest.raises(ShapeFileError) as info:
        parse_shapes(f)
    assert str(info.value).startswith(f"{f}:2: ")
    assert words in str(info.value).lower()


def test_empty_file_is_an_error(tmp_path):
    f = tmp_path / "empty.txt"
    f.write_text("# nothing\n")
    with pytest.raises(ShapeFileError, match=":1: the file lists no GEMM keys"):
        parse_shapes(f)


def test_multimodal_config_reads_text_config_and_defaults():
    shape = DecoderShape.from_config({"text_config": {
        "hidden_size": 2560, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
        "intermediate_size": 10240}})
    assert shape.projections() == {
        "qkv": (4096, 2560), "o": (2560, 2048), "gate_up": (20480, 2560), "down": (2560, 10240)}
    llama = DecoderShape.from_config({"hidden_size": 4096, "num_attention_heads": 32, "intermediate_size": 11008})
    assert llama.projections()["qkv"] == (3 * 4096, 4096)
    with pytest.raises(ValueError, match="intermediate_size"):
        DecoderShape.from_config({"hidden_size": 1, "num_attention_heads": 1})


@pytest.mark.parametrize("fields, words", [
    ({"model_type": "mixtral", "num_local_experts": 8}, "num_local_experts=8: the config describes a mixture"),
    ({"text_config": {"num_experts": 60}}, "num_experts=60: the config describes a mixture of experts"),
    ({"kv_lora_rank": 512}, "kv_lora_rank=512: the config describes multi-head latent attention"),
    ({"model_type": "gpt_neox"}, "model_type 'gpt_neox' has an MLP without a gate"),
])
def test_a_config_whose_layer_is_not_dense_and_gated_is_refused_naming_the_field(fields, words):
    dense = {"hidden_size": 4096, "num_attention_heads": 32, "intermediate_size": 11008}
    config = {**dense, **fields}
    if "text_config" in fields:
        config = {"text_config": {**dense, **fields["text_config"]}}
    with pytest.raises(ValueError, match=words) as info:
        DecoderShape.from_config(config)
    assert "--from-model" in str(info.value)
    # A dense model's config that states no experts is taken.
    assert DecoderShape.from_config({**dense, "num_experts": 0, "model_type": "llama"}).intermediate_size == 11008


def test_cli_writes_a_shape_file_from_a_config_that_parses_back(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({
        "_name_or_path": "google/gemma-3-1b-it", "hidden_size": 1152, "num_attention_heads": 4,
        "num_key_value_heads": 1, "head_dim": 256, "intermediate_size": 6912}))
    out = tmp_path / "g1b.txt"
    proc = subprocess.run(
        [sys.executable, "-m", "tuner.cli", "shapes", "--from-config", str(config), "--m", "1,512", "-o", str(out)],
        capture_output=True, text=True, cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr
    entries = parse_shapes(out)
    assert {(e.problem.m, e.problem.n, e.problem.k) for e in entries} >= {(1, 1536, 1152), (512, 1152, 6912)}
    assert len(entries) == 8
    assert write_shapes_from_config(config, [1, 512], None) == out.read_text()


def test_cli_rejects_a_bad_config_with_exit_code_2(tmp_path):
    config = tmp_path / "config.json"
    config.write_text("[1, 2]")
    proc = subprocess.run(
        [sys.executable, "-m", "tuner.cli", "shapes", "--from-config", str(config)],
        capture_output=True, text=True, cwd=ROOT,
    )
    assert proc.returncode == 2
    assert "expected a JSON object" in proc.stdout + proc.stderr
