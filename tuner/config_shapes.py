"""Shape files from a Hugging Face style config.json (`tuner shapes --from-config`).

A decoder layer's GEMMs, as a serving engine runs them (y = x @ W.T):

- attention: fused QKV and the output projection; or, for multi-head latent
  attention (DeepSeek-V2/V3: `kv_lora_rank`), its down- and up-projections
  of the query and of the compressed KV, and the output projection;
- a dense gated MLP: fused gate+up and down;
- a mixture of experts (Mixtral, Qwen2/3-MoE, DeepSeek-V2/V3): the router,
  the routed experts' fused gate+up and down as grouped keys (`groups=E`,
  M = the rows routed: top-k x tokens), and the shared experts as dense
  keys. Models whose layers mix dense and MoE MLPs get both.

M values are tokens on one GPU. With expert parallelism over N GPUs
(`--ep N`) each holds E / N experts and, with balanced routing, receives
top-k x M rows for them: the grouped keys take `groups=E/N` and the same rows.

What a config does not let us describe (an MLP without a gate, a field it
lacks) is refused, naming the field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

# Config fields that name a mixture of experts' routed-expert count.
EXPERT_COUNT_FIELDS = ("num_local_experts", "num_experts", "n_routed_experts")
_UNGATED_MLP = frozenset({"gpt2", "gpt_bigcode", "gpt_neox", "gptj", "codegen", "starcoder2", "falcon", "phi",
                          "opt", "bloom", "mpt", "nemotron", "arcee"})


def _int(config: dict, field: str, default: int | None = None) -> int:
    value = config.get(field)
    if value is None:
        value = default
    if value is None:
        raise ValueError(f"config has no {field!r}")
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{field}={value!r}: expected a non-negative integer")
    return value


@dataclass(frozen=True)
class Attention:
    """Grouped-query attention: fused QKV, then the output projection."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int

    def gemms(self) -> dict[str, tuple[int, int]]:
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return {"qkv": (q + 2 * kv, self.hidden), "o": (self.hidden, q)}


@dataclass(frozen=True)
class LatentAttention:
    """Multi-head latent attention: queries through a rank-`q_rank` bottleneck
    (none when 0), keys and values through a shared rank-`kv_rank` latent
    plus a decoupled rotary part."""

    hidden: int
    heads: int
    q_rank: int
    kv_rank: int
    nope_dim: int
    rope_dim: int
    v_dim: int

    def gemms(self) -> dict[str, tuple[int, int]]:
        q_out = self.heads * (self.nope_dim + self.rope_dim)
        out = {"q_a": (self.q_rank, self.hidden), "q_b": (q_out, self.q_rank)} if self.q_rank else \
            {"q": (q_out, self.hidden)}
        return out | {
            "kv_a": (self.kv_rank + self.rope_dim, self.hidden),
            "kv_b": (self.heads * (self.nope_dim + self.v_dim), self.kv_rank),
            "o": (self.hidden, self.heads * self.v_dim),
        }


@dataclass(frozen=True)
class Experts:
    """Routed experts of one width (`top_k` of `count` a token) and the
    shared experts beside them (`shared_width` 0: none)."""

    hidden: int
    count: int
    top_k: int
    width: int
    shared_width: int = 0


@dataclass(frozen=True)
class DecoderShape:
    """What a decoder's GEMMs depend on. `intermediate_size` is the dense
    MLP's width (0: every layer's MLP is a mixture of experts)."""

    attention: Attention | LatentAttention
    intermediate_size: int
    experts: Experts | None = None

    @classmethod
    def from_config(cls, config: dict) -> DecoderShape:
        # Multimodal checkpoints (Gemma 3 4B and up) keep the LM under text_config.
        text = config.get("text_config") or config
        for c in (config, text):
            if c.get("model_type") in _UNGATED_MLP:
                raise ValueError(f"model_type {c['model_type']!r} has an MLP without a gate, where --from-config "
                                 "derives a gated one (gate+up); list the model's own GEMMs with --from-model")
        hidden = _int(text, "hidden_size")
        experts = _experts(text, hidden)
        dense = _dense_width(text, experts)
        return cls(_attention(text, hidden), dense, experts)

    def gemms(self, ep: int = 1) -> list[tuple[str, int, int, int, int]]:
        """(name, N, K, groups, rows per token) of every GEMM of a layer."""
        out = [(name, n, k, 1, 1) for name, (n, k) in self.attention.gemms().items()]
        if self.intermediate_size:
            out += [("gate_up", 2 * self.intermediate_size, self.attention.hidden, 1, 1),
                    ("down", self.attention.hidden, self.intermediate_size, 1, 1)]
        e = self.experts
        if e is not None:
            if e.count % ep:
                raise ValueError(f"--ep {ep}: {e.count} experts do not split into {ep} equal parts")
            out.append(("router", e.count, e.hidden, 1, 1))
            out += [("experts.gate_up", 2 * e.width, e.hidden, e.count // ep, e.top_k),
                    ("experts.down", e.hidden, e.width, e.count // ep, e.top_k)]
            if e.shared_width:
                out += [("shared.gate_up", 2 * e.shared_width, e.hidden, 1, 1),
                        ("shared.down", e.hidden, e.shared_width, 1, 1)]
        return out

    def describe(self) -> str:
        a, e = self.attention, self.experts
        if isinstance(a, LatentAttention):
            text = f"hidden {a.hidden}, {a.heads} heads of latent attention (KV rank {a.kv_rank})"
        else:
            text = f"hidden {a.hidden}, {a.heads} query heads and {a.kv_heads} KV heads of {a.head_dim}"
        if self.intermediate_size:
            text += f", MLP {self.intermediate_size}"
        if e is not None:
            text += f", {e.count} experts of {e.width} ({e.top_k} a token)"
            if e.shared_width:
                text += f", shared experts of {e.shared_width}"
        return text


def _attention(text: dict, hidden: int) -> Attention | LatentAttention:
    heads = _int(text, "num_attention_heads")
    if text.get("kv_lora_rank"):
        return LatentAttention(hidden, heads, _int(text, "q_lora_rank", 0), _int(text, "kv_lora_rank"),
                               _int(text, "qk_nope_head_dim"), _int(text, "qk_rope_head_dim"),
                               _int(text, "v_head_dim"))
    if not heads:
        raise ValueError("num_attention_heads=0: expected at least one head")
    return Attention(hidden, heads, _int(text, "num_key_value_heads", 0) or heads,
                     _int(text, "head_dim", 0) or hidden // heads)


def _experts(text: dict, hidden: int) -> Experts | None:
    count_field = next((f for f in EXPERT_COUNT_FIELDS if isinstance(text.get(f), int) and text[f] > 1), None)
    if count_field is None:
        return None
    count = text[count_field]
    top_k = _int(text, "num_experts_per_tok")
    # Mixtral's experts are `intermediate_size` wide; the others name theirs.
    width = _int(text, "moe_intermediate_size" if "moe_intermediate_size" in text else "intermediate_size")
    shared = _int(text, "shared_expert_intermediate_size", 0)
    if text.get("n_shared_experts"):
        shared = _int(text, "n_shared_experts") * width
    return Experts(hidden, count, top_k, width, shared)


def _dense_width(text: dict, experts: Experts | None) -> int:
    """The width of the dense MLP layers, if some layers have one."""
    if experts is None:
        return _int(text, "intermediate_size")
    dense_layers = (text.get("first_k_dense_replace") or text.get("mlp_only_layers")
                    or (text.get("decoder_sparse_step") or 1) > 1 or (text.get("moe_layer_freq") or 1) > 1)
    if not dense_layers or "moe_intermediate_size" not in text:
        return 0
    return _int(text, "intermediate_size")


def shape_lines(model: str, shape: DecoderShape, m_values: list[int], ep: int = 1) -> list[str]:
    lines = [f"# {model}: {shape.describe()}"]
    if shape.experts is not None:
        lines.append(f"# expert keys: M = rows routed (top-k x tokens), {shape.experts.count // ep} experts "
                     f"a GPU" + (f" (--ep {ep})" if ep > 1 else ""))
    for name, n, k, groups, per_token in shape.gemms(ep):
        ms = ",".join(str(m * per_token) for m in m_values)
        lines.append(f"{ms} {n} {k}" + (f" groups={groups}" if groups > 1 else "") + f" name={model}.{name}")
    return lines


def write_shapes_from_config(config_path: Path, m_values: list[int], output: Path | None, ep: int = 1) -> str:
    """The shape file text for a Hugging Face style config.json; written to `output` if given."""
    if not m_values or any(m < 1 for m in m_values):
        raise ValueError("M values must be positive integers")
    if ep < 1:
        raise ValueError(f"--ep {ep}: expected a positive number of GPUs")
    config = json.loads(Path(config_path).read_text())
    if not isinstance(config, dict):
        raise ValueError("expected a JSON object")
    model = str(config.get("_name_or_path") or config.get("model_type") or Path(config_path).stem)
    model = model.replace(" ", "_")
    text = "\n".join(shape_lines(model, DecoderShape.from_config(config), m_values, ep)) + "\n"
    if output is not None:
        output.write_text(text)
    return text
