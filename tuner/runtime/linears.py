"""A model's linear layers as GEMM keys: shape files from a model.

A model source is one of

- a Hugging Face style `config.json` (a path), or the name of one shipped in
  `tuner/data/models/` (`gemma-3-27b` text, `llama-3.1-8b`, `qwen2.5-7b`):
  `transformers` (a dev extra, not a runtime dependency) builds the causal
  LM from it on the meta device, so no weight is allocated and nothing is
  downloaded;
- `package.module:attr`: an `nn.Module`, or a callable returning one.

Every `nn.Linear` of the model (subclasses included) is one GEMM y = x @ W.T
with (N, K) = (out_features, in_features): the projections as the model
really runs them (a Hugging Face Llama runs q, k and v as three GEMMs, where
`shapes --from-config` states the fused QKV a serving engine runs).
"""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass
from pathlib import Path

from tuner.config_shapes import EXPERT_COUNT_FIELDS
from tuner.shapes import DATA_DIR

MODELS_DIR = DATA_DIR / "models"
_DTYPES = {"float16": "fp16", "bfloat16": "bf16"}


class ModelSourceError(ValueError):
    """A model source that cannot be read or built; the message names it."""


@dataclass(frozen=True)
class LinearShape:
    """One distinct (N, K) of a model's linear layers and the layers that run
    it: their leaf names, qualified by the modules above where a leaf name
    runs another shape too (`linear_shapes`)."""

    n: int
    k: int
    names: tuple[str, ...]

    @property
    def label(self) -> str:
        """The names joined by "+", a qualifier they share written once
        ("shared_experts.gate_proj+up_proj")."""
        heads = {name.rpartition(".")[0] for name in self.names}
        if len(heads) == 1 and (head := heads.pop()):
            return f"{head}." + "+".join(name.rpartition(".")[2] for name in self.names)
        return "+".join(self.names)


def shipped_models() -> list[str]:
    return sorted(p.stem for p in MODELS_DIR.glob("*.json"))


def config_path(source: str | Path) -> Path | None:
    """The config file `source` names (a path, or a shipped config's name), or None
    for a `module:attr` source."""
    path = Path(source)
    if path.is_file():
        return path
    shipped = MODELS_DIR / f"{path.name.removesuffix('.json')}.json"
    if path.parent == Path(".") and shipped.is_file():
        return shipped
    if ":" in str(source) and path.suffix != ".json":
        return None
    raise ModelSourceError(
        f"{source}: no such config file, shipped model config ({', '.join(shipped_models())}) "
        "or package.module:attr")


def load_config(path: Path) -> dict:
    try:
        config = json.loads(path.read_text())
    except OSError as exc:
        raise ModelSourceError(f"{path}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise ModelSourceError(f"{path}: not JSON: {exc}") from None
    if not isinstance(config, dict) or "model_type" not in config:
        raise ModelSourceError(f"{path}: expected a config object with a 'model_type'")
    return config


def model_name(source: str | Path) -> str:
    """The name shape-file keys take: the config's `_name_or_path`, else the source's stem."""
    path = config_path(source)
    if path is None:
        return str(source).rpartition(":")[2]
    return str(load_config(path).get("_name_or_path") or path.stem).replace(" ", "_")


def build_model(source: str | Path, *, num_layers: int | None = None, device="meta", dtype=None):
    """The model of `source` (module doc); a config-built one gets `num_layers`
    decoder layers when given, its weights on `device` (random unless meta) in
    `dtype` (default: the config's)."""
    import torch

    path = config_path(source)
    if path is None:
        return _import_module(str(source))
    config = load_config(path)
    try:
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError:
        raise ModelSourceError(f"{path}: building a model from a config needs `transformers` "
                               "(pip install 'gemm-tuner[dev]')") from None
    from transformers import CONFIG_MAPPING, __version__

    fields = {k: v for k, v in config.items() if not k.startswith("_")}
    model_type = fields.pop("model_type")
    if model_type not in CONFIG_MAPPING:
        raise ModelSourceError(f"{path}: model_type {model_type!r} is not one transformers {__version__} knows")
    if num_layers is not None:
        fields = _truncated(fields, num_layers)
    try:
        hf_config = AutoConfig.for_model(model_type, **fields)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype or _torch_dtype(config))
    except Exception as exc:  # transformers' validators raise their own types: each is reported, on one line
        raise ModelSourceError(f"{path}: transformers cannot build it: {' '.join(str(exc).split())}") from None
    return model.eval()


def _truncated(fields: dict, num_layers: int) -> dict:
    """`fields` of a config with `num_layers` decoder layers: lists of one
    entry a layer (`layer_types`, which transformers checks against the layer
    count) keep the first `num_layers` entries."""
    total = fields.get("num_hidden_layers")
    per_layer = {k: v[:num_layers] for k, v in fields.items() if isinstance(v, list) and total and len(v) == total}
    return {**fields, **per_layer, "num_hidden_layers": num_layers}


def linear_shapes(model) -> list[LinearShape]:
    """The distinct (N, K) of the model's linear layers, in module order, each
    named by its layers' leaf names; a leaf name that runs more than one
    shape takes the module names above it until it runs one (DeepSeek-V3's
    dense `mlp.gate_proj` and its `shared_experts.gate_proj`)."""
    from torch import nn

    found: dict[tuple[int, int], list[str]] = {}
    for path, module in model.named_modules():
        if isinstance(module, nn.Linear):
            found.setdefault((module.out_features, module.in_features), []).append(path)
    depth = {path: 1 for paths in found.values() for path in paths}
    while True:
        shapes_of: dict[str, set] = {}
        for shape, paths in found.items():
            for path in paths:
                shapes_of.setdefault(_qualified(path, depth[path]), set()).add(shape)
        clashing = [path for paths in found.values() for path in paths
                    if len(shapes_of[_qualified(path, depth[path])]) > 1 and depth[path] < path.count(".") + 1]
        if not clashing:
            break
        for path in clashing:
            depth[path] += 1
    return [LinearShape(n, k, tuple(dict.fromkeys(_qualified(p, depth[p]) for p in paths)))
            for (n, k), paths in found.items()]


def _qualified(path: str, depth: int) -> str:
    """The last `depth` names of a module path, list indices left out (of a
    path of indices only, its last; of the model itself, "linear")."""
    names = [name for name in path.split(".") if not name.isdigit()]
    return ".".join(names[-depth:]) if names else path.rpartition(".")[2] or "linear"


def shapes_from_model(source: str | Path, m_values: list[int], fuse: bool = False) -> str:
    """The shape file text of every distinct linear (N, K) of the model of
    `source`; with `fuse`, and of the products `patch(fuse=True)` computes
    over sibling layers' weights together (`tuner.runtime.fusion`)."""
    from tuner.runtime.fusion import sibling_shapes

    if not m_values or any(m < 1 for m in m_values):
        raise ValueError("M values must be positive integers")
    name = model_name(source)
    model = build_model(source)
    path = config_path(source)
    dtype = _DTYPES.get(_dtype_name(load_config(path)) if path else _module_dtype(model), "bf16")
    shapes = linear_shapes(model)
    if not shapes:
        raise ModelSourceError(f"{source}: the model has no nn.Linear layer")
    ms = ",".join(map(str, m_values))
    lines = [f"# {name}: the {len(shapes)} distinct linear-layer shapes (N K) of the model as built "
             f"from {Path(path).name if path else source}"]

    def listed(shape: LinearShape, label: str) -> str:
        line = f"{ms} {shape.n} {shape.k} dtype={dtype} name={name}.{label}"
        why = _outside_the_pool(shape, dtype)
        # A shape no kernel can take (a gate of one output) stays in the file
        # as a comment, so that the file still tunes and says what runs cuBLAS.
        return line if why is None else f"# {line}: runs cuBLAS, {why}"

    lines += [listed(s, s.label) for s in shapes]
    fused = sibling_shapes(model) if fuse else []
    if fused:
        lines.append("# fused siblings, one product each under patch(model, fuse=True):")
    known = {(s.n, s.k): s.label for s in shapes}
    for label, n, k in fused:
        # A shape listed above is one family already, tuned under that name.
        lines.append(f"# fused.{label}: {n} {k}, as {known[n, k]} above" if (n, k) in known
                     else listed(LinearShape(n, k, (label,)), f"fused.{label}"))
    top_k, grouped, other = expert_keys(model, load_config(path) if path else {})
    if grouped:
        lines.append(f"# experts (3-D weights, y = x @ W[e].T): M = rows routed, top-{top_k} x tokens")
        lines += [f"{','.join(str(m * top_k) for m in m_values)} {n} {k} groups={e} dtype={dtype} name={name}.{label}"
                  for label, e, n, k in grouped]
    if other:
        lines.append("# not listed: 3-D weights the config names no expert count and top-k for:")
        lines += [f"#   {w}" for w in other]
    return "\n".join(lines) + "\n"


def _outside_the_pool(shape: LinearShape, dtype: str) -> str | None:
    """Why no kernel of the pool takes this weight's products (None if one may)."""
    from kernels.space import InvalidConfig
    from tuner.key import Problem

    try:
        Problem(1, shape.n, shape.k, 1, dtype, dtype, "tn")
    except InvalidConfig as exc:
        return str(exc)
    return None


def expert_keys(model, config: dict) -> tuple[int, list[tuple[str, int, int, int]], list[str]]:
    """The config's top-k and the grouped keys of the model's experts:
    (label, E, N, K) of every distinct 3-D floating weight (E, N, K) whose E
    is the config's expert count (when it names a top-k); and `Module.param
    ExNxK` of the other 3-D weights but convolutions' (a Mamba layer's
    conv1d is 3-D too)."""
    from torch import nn

    text = config.get("text_config") or config
    counts = {text[f] for f in EXPERT_COUNT_FIELDS if isinstance(text.get(f), int)}
    top_k = text.get("num_experts_per_tok")
    routed = bool(counts) and isinstance(top_k, int)
    grouped: dict[tuple[int, int, int], list[str]] = {}
    other: dict[str, None] = {}
    for mod_name, module in model.named_modules():
        if isinstance(module, nn.modules.conv._ConvNd):
            continue
        for name, p in module.named_parameters(recurse=False):
            if p.dim() != 3 or not p.is_floating_point():
                continue
            if routed and p.shape[0] in counts:
                labels = grouped.setdefault(tuple(p.shape), [])
                label = f"{mod_name.rpartition('.')[2]}.{name}"
                if label not in labels:
                    labels.append(label)
            else:
                other[f"{type(module).__name__}.{name} {'x'.join(map(str, p.shape))}"] = None
    return top_k, [("+".join(labels), e, n, k) for (e, n, k), labels in grouped.items()], list(other)


def _import_module(source: str):
    from torch import nn

    module_name, _, attr = source.partition(":")
    try:
        obj = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ModelSourceError(f"{source}: {exc}") from None
    if callable(obj) and not isinstance(obj, nn.Module):
        try:
            obj = obj()
        except Exception as exc:  # the user's factory: whatever it raises is reported, naming it
            raise ModelSourceError(f"{source}: calling it failed: {type(exc).__name__}: {exc}") from None
    if not isinstance(obj, nn.Module):
        raise ModelSourceError(f"{source}: is {type(obj).__name__}, not an nn.Module or a callable returning one")
    return obj


def _dtype_name(config: dict) -> str:
    text = config.get("text_config") or {}
    return str(config.get("dtype") or config.get("torch_dtype") or text.get("dtype") or "bfloat16")


def _torch_dtype(config: dict):
    import torch

    return torch.float16 if _dtype_name(config) == "float16" else torch.bfloat16


def _module_dtype(model) -> str:
    params = [p for p in model.parameters() if p.is_floating_point()]
    return str(params[0].dtype).removeprefix("torch.") if params else "bfloat16"
