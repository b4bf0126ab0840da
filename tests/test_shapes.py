"""Shape files: the line format, the shipped Gemma 3 file, and files written from model configs."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tuner.config_shapes import DecoderShape, write_shapes_from_config
from tuner.shapes import ShapeFileError, parse_shapes

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
        "64 4096 1024 overlap=allreduce:11010048\n"
    )
    entries = parse_shapes(f)
    assert [e.line for e in entries] == [3, 3, 4, 5, 6, 8]
    dense, _, moe, mixed, held, beside = (e.problem for e in entries)
    assert beside.overlap == 11010048 and beside.label() == "64x4096x1024 allreduce:11010048"
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
    ("16 4096 4096 overlap=allgather:1024", "overlap takes allreduce:bytes"),
    ("16 4096 4096 overlap=allreduce", "overlap takes allreduce:bytes"),
    ("16 4096 4096 overlap=allreduce:lots", "overlap's bytes must be an integer"),
    ("16 4096 4096 overlap=allreduce:0", "overlap's bytes must be 1 to"),
    ("16 4096 4096 overlap=allreduce:4096 held=8", "held and overlap both"),
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


def _gemms(shape: DecoderShape, ep: int = 1) -> dict:
    return {name: (n, k, groups, per_token) for name, n, k, groups, per_token in shape.gemms(ep)}


def test_multimodal_config_reads_text_config_and_defaults():
    shape = DecoderShape.from_config({"text_config": {
        "hidden_size": 2560, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
        "intermediate_size": 10240}})
    assert _gemms(shape) == {"qkv": (4096, 2560, 1, 1), "o": (2560, 2048, 1, 1), "gate_up": (20480, 2560, 1, 1),
                             "down": (2560, 10240, 1, 1)}
    llama = DecoderShape.from_config({"hidden_size": 4096, "num_attention_heads": 32, "intermediate_size": 11008})
    assert _gemms(llama)["qkv"] == (3 * 4096, 4096, 1, 1)
    with pytest.raises(ValueError, match="intermediate_size"):
        DecoderShape.from_config({"hidden_size": 1, "num_attention_heads": 1})


@pytest.mark.parametrize("fields, words", [
    ({"model_type": "mixtral", "num_local_experts": 8}, "config has no 'num_experts_per_tok'"),
    ({"num_experts": 60, "num_experts_per_tok": 4, "moe_intermediate_size": None}, "no 'moe_intermediate_size'"),
    ({"kv_lora_rank": 512, "qk_nope_head_dim": 128}, "config has no 'qk_rope_head_dim'"),
    ({"num_attention_heads": 0}, "num_attention_heads=0"),
    ({"intermediate_size": "big"}, "intermediate_size='big': expected a non-negative integer"),
    ({"model_type": "gpt_neox"}, "model_type 'gpt_neox' has an MLP without a gate"),
])
def test_what_a_config_does_not_describe_is_refused_naming_the_field(fields, words):
    dense = {"hidden_size": 4096, "num_attention_heads": 32, "intermediate_size": 11008}
    with pytest.raises(ValueError, match=words):
        DecoderShape.from_config({**dense, **fields})
    # A dense model's config that states no experts is taken.
    assert DecoderShape.from_config({**dense, "num_experts": 0, "model_type": "llama"}).intermediate_size == 11008


CONFIGS = ROOT / "bench" / "configs"


def test_moe_configs_give_grouped_expert_keys_beside_the_dense_ones():
    qwen = _gemms(DecoderShape.from_config(json.loads((CONFIGS / "qwen3-30b-a3b.json").read_text())))
    assert qwen == {"qkv": (5120, 2048, 1, 1), "o": (2048, 4096, 1, 1), "router": (128, 2048, 1, 1),
                    "experts.gate_up": (1536, 2048, 128, 8), "experts.down": (2048, 768, 128, 8)}
    mixtral = _gemms(DecoderShape.from_config(json.loads((CONFIGS / "mixtral-8x7b.json").read_text())))
    assert mixtral["experts.gate_up"] == (2 * 14336, 4096, 8, 2) and "gate_up" not in mixtral
    v3 = DecoderShape.from_config(json.loads((CONFIGS / "deepseek-v3.json").read_text()))
    got = _gemms(v3)
    # Latent attention, the first three layers' dense MLP, one shared expert.
    assert {k: got[k] for k in ("q_a", "q_b", "kv_a", "kv_b", "o")} == {
        "q_a": (1536, 7168, 1, 1), "q_b": (128 * 192, 1536, 1, 1), "kv_a": (576, 7168, 1, 1),
        "kv_b": (128 * 256, 512, 1, 1), "o": (7168, 128 * 128, 1, 1)}
    assert got["gate_up"] == (2 * 18432, 7168, 1, 1) and got["shared.down"] == (7168, 2048, 1, 1)
    assert got["experts.down"] == (7168, 2048, 256, 8)
    # Expert parallelism over 64 GPUs: 4 experts each, the same rows.
    assert _gemms(v3, ep=64)["experts.gate_up"] == (4096, 7168, 4, 8)
    with pytest.raises(ValueError, match="--ep 3: 256 experts do not split into 3 equal parts"):
        v3.gemms(ep=3)


@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "mixtral-8x7b", "deepseek-v3"])
def test_a_moe_shape_file_from_a_config_is_one_tune_accepts(tmp_path, name):
    out = tmp_path / f"{name}.txt"
    proc = subprocess.run(
        [sys.executable, "-m", "tuner.cli", "shapes", "--from-config", str(CONFIGS / f"{name}.json"),
         "--m", "4,2048", "--ep", "2", "-o", str(out)], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    entries = parse_shapes(out)
    grouped = [e for e in entries if e.problem.groups > 1]
    assert grouped and all(e.name.split(".", 1)[1].startswith("experts.") for e in grouped)
    # The routed rows are top-k x tokens.
    top_k = json.loads((CONFIGS / f"{name}.json").read_text())["num_experts_per_tok"]
    assert {e.problem.m for e in grouped} == {4 * top_k, 2048 * top_k}
    tune = subprocess.run(
        [sys.executable, "-m", "tuner.cli", "tune", "--shapes", str(out), "--backend", "model", "--trials", "2",
         "--no-ladder", "--only", "*.experts.*", "--db", str(tmp_path / "t.db"), "--json"],
        capture_output=True, text=True, cwd=ROOT)
    assert tune.returncode == 0, tune.stderr
    assert json.loads(tune.stdout)["totals"]["tuned"] == 2


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
