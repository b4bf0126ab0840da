"""Host time of `gemm`'s registered op inside a compiled forward against a loop.

    TUNER_DB=DB python -m bench.probes.compiled_op_host

A compiled graph run from Python calls `gemm_tuner::gemm` from its wrapper
code. This times, on a (1, 2048) x (2048, 128256) bf16 product (SmolLM3
3B's lm_head at M = 1), `torch.mm`, `F.linear`, `gemm`, the op and the
kept runner alone, each per call in batches of 200 without a sync (fastest
of five); then SmolLM3 3B's config (`bench/configs/smollm3-3b.json`, two
decoder layers, random bf16 weights) under `torch.compile`, unpatched and
patched from DB (`tuner.patch`), one decode step at a time into a static
cache: the step's enqueue time (median of 200) and the host time spent in
`dispatch`'s call path a step, which a decode step with the lm_head kernel
takes inside the graph. Prints what it measured (`tuner.patch`'s
`_COMPILED_IN_FORWARD` rests on it).
"""
import copy
import statistics
import time

import torch
from transformers import StaticCache

import tuner
from tuner.runtime import dispatch
from tuner.runtime.linears import build_model

CONFIG = "bench/configs/smollm3-3b.json"


def per_call(fn, n=200):
    """us a call on the host: the fastest of five batches of `n`, synced between."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    best = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best.append((time.perf_counter() - t0) / n * 1e6)
        torch.cuda.synchronize()
    return round(min(best), 1)


def main() -> None:
    w = torch.randn(128256, 2048, device="cuda", dtype=torch.bfloat16)
    a = torch.randn(1, 2048, device="cuda", dtype=torch.bfloat16)
    wt = w.t()
    print("eager: mm", per_call(lambda: torch.mm(a, wt)), "F.linear",
          per_call(lambda: torch.nn.functional.linear(a, w)), "gemm", per_call(lambda: dispatch.gemm(a, wt)),
          "op", per_call(lambda: torch.ops.gemm_tuner.gemm(a, wt)), flush=True)
    launch = dispatch.launcher(a, wt)
    print("launcher", launch, flush=True)
    if launch is not None:
        out = torch.empty(1, 128256, device="cuda", dtype=torch.bfloat16)
        print("runner alone", per_call(lambda: launch.runner(a, w, out)), flush=True)

    # Time spent in dispatch's call path during the compiled forwards.
    spent = {"run": 0.0, "n": 0, "slow": 0}
    run = dispatch._run

    def timed_run(a, b, out, offs):
        hit = dispatch._state.launchers.get(dispatch._signature(a, b, out, offs)) is not None
        t0 = time.perf_counter()
        got = run(a, b, out, offs)
        spent["run"] += time.perf_counter() - t0
        spent["n"] += 1
        spent["slow"] += not hit
        return got
    dispatch._run = timed_run

    torch.manual_seed(0)
    model = build_model(CONFIG, num_layers=2, device="cuda", dtype=torch.bfloat16)
    tuned = copy.deepcopy(model)
    tuner.patch(tuned)
    tok = torch.randint(0, 1000, (1, 1), device="cuda")
    pos = torch.tensor([128], device="cuda")
    with torch.no_grad():
        for name, m in (("unpatched", model), ("patched", tuned)):
            cache = StaticCache(config=m.config, max_cache_len=512)
            compiled = torch.compile(m)

            def step():
                cache.reset()
                return compiled(input_ids=tok, past_key_values=cache, cache_position=pos).logits
            for _ in range(5):
                step()
            torch.cuda.synchronize()
            spent.update(run=0.0, n=0, slow=0)
            enqueue = []
            for _ in range(200):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                step()
                enqueue.append(time.perf_counter() - t0)
            print(name, "enqueue median us", round(statistics.median(enqueue) * 1e6, 1), "in _run per step us",
                  round(spent["run"] / 200 * 1e6, 1), "calls", spent["n"], "misses", spent["slow"], flush=True)


if __name__ == "__main__":
    main()
