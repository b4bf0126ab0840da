"""How far a decode step's logits move when only the GEMMs' rounding changes.

    python -m bench.probes.decode_error --db DB [--models llama-3.1-8b] [--layers 8]
                                         [--decode 1,16] [--steps 64] [--prompt 128]

`bench.e2e` compares the patched model's logits with the unpatched one's,
teacher-forced on the unpatched run's greedy tokens, against a limit of 2e-2.
This asks what that error is made of: the same comparison, on the same
random-weight model and tokens, for variants that change nothing but how
the linear layers' products are rounded and summed:

- `cublas_exact_reduction`: cuBLAS with bf16 reduced-precision reductions
  off (`torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction`);
- `fp32_products`: every linear layer's product in fp32 (operands upcast,
  the result rounded to bf16 once), more exact than either kernel;
- `tuner`: `patch(model, graphs=True)` over DB, every map interval kept (no
  `check`), as `bench.e2e --graphs --check-rounds 0` runs it.

Prints per model and batch the largest step error of each variant against
plain cuBLAS and against `fp32_products`; writes
`$OUT/<device>-decode-error.json` (`--out`, default bench/results).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.e2e import _rel_err
from bench.kernels_sm90 import device_slug
from tuner import patch
from tuner.runtime import dispatch
from tuner.runtime.linears import build_model

DEVICE = "cuda"


@contextlib.contextmanager
def _exact_reduction():
    flags = torch.backends.cuda.matmul
    saved = flags.allow_bf16_reduced_precision_reduction
    flags.allow_bf16_reduced_precision_reduction = False
    try:
        yield
    finally:
        flags.allow_bf16_reduced_precision_reduction = saved


@contextlib.contextmanager
def _fp32_products():
    linear = F.linear

    def upcast(x, w, b=None):
        y = linear(x.float(), w.float(), None if b is None else b.float())
        return y.to(x.dtype)

    F.linear = upcast
    try:
        yield
    finally:
        F.linear = linear


def _forced_logits(model, batch: int, args, context, tokens=None) -> tuple[list, list]:
    """`args.steps` decode steps of `model` under `context` after a prompt
    seeded by `batch`: each step fed the token `tokens` gives it (greedy
    where None); (every step's logits, the tokens fed after each)."""
    from transformers import StaticCache

    gen = torch.Generator(device=DEVICE).manual_seed(batch)
    vocab = model.config.vocab_size
    prompt = torch.randint(0, vocab, (batch, args.prompt), device=DEVICE, generator=gen)
    token = torch.randint(0, vocab, (batch, 1), device=DEVICE, generator=gen)
    cache = StaticCache(config=model.config, max_cache_len=args.prompt + args.steps)
    logits, fed = [], []
    with context():
        model(input_ids=prompt, past_key_values=cache, cache_position=torch.arange(args.prompt, device=DEVICE),
              logits_to_keep=1)
        for i in range(args.steps):
            position = torch.tensor([args.prompt + i], device=DEVICE)
            last = model(input_ids=token, past_key_values=cache, cache_position=position).logits[:, -1].clone()
            logits.append(last)
            token = last.argmax(-1, keepdim=True) if tokens is None else tokens[i]
            fed.append(token)
    return logits, fed


def _largest(got: list, want: list) -> float:
    return max(_rel_err(g, w) for g, w in zip(got, want, strict=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--db", required=True)
    parser.add_argument("--models", type=lambda t: t.split(","), default=["llama-3.1-8b"])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--decode", type=lambda t: [int(b) for b in t.split(",")], default=[1, 16])
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args()
    dispatch.configure(args.db)
    record = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "steps": args.steps,
              "layers": args.layers, "cases": []}
    for name in args.models:
        torch.manual_seed(0)
        model = build_model(name, num_layers=args.layers, device=DEVICE, dtype=torch.bfloat16)
        tuned = patch(copy.deepcopy(model), graphs=True)
        variants = {"cublas_exact_reduction": (model, _exact_reduction), "fp32_products": (model, _fp32_products),
                    "tuner": (tuned, contextlib.nullcontext)}
        with torch.inference_mode():
            for batch in args.decode:
                want, tokens = _forced_logits(model, batch, args, contextlib.nullcontext)
                got = {label: _forced_logits(m, batch, args, context, tokens)[0]
                       for label, (m, context) in variants.items()}
                exact = got["fp32_products"]
                case = {"model": name, "batch": batch,
                        "vs_cublas": {label: _largest(g, want) for label, g in got.items()},
                        "vs_fp32_products": {"cublas": _largest(want, exact)} | {
                            label: _largest(g, exact) for label, g in got.items() if label != "fp32_products"}}
                record["cases"].append(case)
                print(f"{name} batch {batch}: vs cuBLAS " + ", ".join(
                    f"{k} {v:.1e}" for k, v in case["vs_cublas"].items()) + "; vs fp32 products " + ", ".join(
                    f"{k} {v:.1e}" for k, v in case["vs_fp32_products"].items()), flush=True)
    path = Path(os.environ.get("OUT") or args.out) / f"{device_slug(record['device'])}-decode-error.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
