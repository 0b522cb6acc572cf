"""Lab: device memory as the driver counts it, against what od-moe plans, on a CUDA machine.

Not product code. Each `run` is a fresh process (the driver's count is per process): it loads a model at
one capacity (or with none: the device budget chooses), generates, and prints one JSON line with NVML's
count for the process after the CUDA context exists, after load and after generation, MLX's own counters
(active, cache, peak), the card's free memory, and what `od_moe.inspect_model` and the engine planned.
`stock` does the same for stock mlx-lm fully resident; `hold GB` keeps all but GB of the card taken by a
PyTorch allocation (a smaller card) until killed.

  python3 lab/device_memory/measure.py run MODEL [CAPACITY|auto] [TOKENS] [PROMPT_TOKENS]
  python3 lab/device_memory/measure.py stock MODEL [TOKENS [PROMPT_TOKENS]]
  python3 lab/device_memory/measure.py hold FREE_GB
"""

import json
import os
import sys
import time


def _nvml_bytes():
    from od_moe.memory import cuda

    return cuda.process_device_bytes(os.getpid())


def _card():
    from od_moe.memory import cuda

    return cuda.memory_info()


def _prompt(tokenizer, n: int) -> str:
    text = "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n\n"
    ids = []
    while len(ids) < n:
        ids += tokenizer.encode(text)
    return tokenizer.decode(ids[:n])


class Peaks:
    """The card's lowest free bytes by phase, polled on a thread every 5 ms (cudaMemGetInfo releases the
    GIL): the driver's peak of this process, where nothing else on the card changes."""

    def __init__(self):
        import threading

        self.phase, self.low, self._stop = "load", {}, False
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def enter(self, phase: str):
        """Count the lowest free bytes from now on under `phase`."""
        self.phase = phase

    def _poll(self):
        while not self._stop:
            free = _card()[0]
            self.low[self.phase] = min(self.low.get(self.phase, free), free)
            time.sleep(0.005)

    def stop(self, start_free: int, context: int) -> dict:
        self._stop = True
        self._thread.join()
        return {k: start_free - v + context for k, v in self.low.items()}


def run(model: str, capacity: str, tokens: int, prompt_tokens: int):
    import mlx.core as mx

    import od_moe
    from od_moe.preflight import inspect_model

    t0 = time.perf_counter()
    card0 = _card()  # makes the context
    out = {"capacity_asked": capacity, "card_free_at_start": card0[0], "card_total": card0[1]}
    out["nvml_context"] = _nvml_bytes()
    report = inspect_model(model, capacity=None if capacity == "auto" else capacity)
    out["inspect"] = report
    peaks = Peaks()
    engine = od_moe.load(model, capacity=None if capacity == "auto" else capacity)
    out["load_s"] = time.perf_counter() - t0
    out["capacity"], out["num_experts"], out["layers"] = (
        engine.capacity,
        engine.num_experts,
        len(engine.caches),
    )
    out["choice"], out["mode"] = engine.capacity_choice, engine.mode
    if os.environ.get("OLD_LIMIT"):  # the bound before 2026-11-27: the whole device budget
        from od_moe.memory import backend

        mx.set_memory_limit(report["device"]["budget_bytes"] + sum(backend._held_in_host.values()))
    out["mlx_limit"] = mx.get_memory_limit()
    out["card_bytes_predicted"] = (report.get("capacity") or {}).get("card_bytes")
    out["nvml_after_load"] = _nvml_bytes()
    out["mlx_after_load"] = {"active": mx.get_active_memory(), "cache": mx.get_cache_memory()}
    prompt = _prompt(engine.tokenizer, prompt_tokens)
    t1 = time.perf_counter()
    first, n, r = None, 0, None
    peaks.enter("prefill")
    try:
        for response in engine.stream_generate(prompt, max_tokens=tokens):
            n, r = n + 1, response
            if first is None:
                first = time.perf_counter() - t1
                peaks.enter("decode")
    except RuntimeError as e:  # out of memory: say where it stood
        out["error"], out["generated"] = str(e), n
        out["mlx_at_error"] = {"active": mx.get_active_memory(), "cache": mx.get_cache_memory()}
        out["mlx_at_error"].update(peak=mx.get_peak_memory(), limit=mx.get_memory_limit())
        out["card_free_at_error"] = _card()[0]
        out["driver_peak_with_context"] = peaks.stop(card0[0], out["nvml_context"])
        print(json.dumps(out), flush=True)
        return
    out["first_token_s"], out["generated"], out["gen_tok_s"] = first, n, r.generation_tps
    out["prompt_tps"] = r.prompt_tps
    out["nvml_after_generate"] = _nvml_bytes()
    out["mlx_after_generate"] = {
        "active": mx.get_active_memory(),
        "cache": mx.get_cache_memory(),
        "peak": mx.get_peak_memory(),
    }
    out["card_free_after"] = _card()[0]
    out["card_after_with_context"] = card0[0] - out["card_free_after"] + out["nvml_context"]
    out["driver_peak_with_context"] = peaks.stop(card0[0], out["nvml_context"])
    out["stats_memory"] = engine.stats()["memory"]
    out["decode_hit"] = engine.stats()["total"]["decode"]["hit_rate"]
    print(json.dumps(out), flush=True)


def stock(model: str, tokens: int = 48, prompt_tokens: int = 0):
    import mlx.core as mx
    from mlx_lm import load, stream_generate

    t0 = time.perf_counter()
    card0 = _card()
    out = {"stock": True, "card_free_at_start": card0[0], "nvml_context": _nvml_bytes()}
    peaks = Peaks()
    m, tok = load(model)
    mx.eval(m.parameters())
    out["load_s"] = time.perf_counter() - t0
    out["nvml_after_load"] = _nvml_bytes()
    out["weights"] = mx.get_active_memory()
    peaks.enter("generate")
    prompt = _prompt(tok, prompt_tokens) if prompt_tokens else "def fibonacci(n):"
    responses = list(stream_generate(m, tok, prompt, max_tokens=tokens))
    out["driver_peak_with_context"] = peaks.stop(card0[0], out["nvml_context"])
    out["mlx_peak"] = mx.get_peak_memory()
    out["gen_tok_s"] = responses[-1].generation_tps
    out["nvml_after_generate"] = _nvml_bytes()
    out["mlx_after_generate"] = {"active": mx.get_active_memory(), "cache": mx.get_cache_memory()}
    print(json.dumps(out), flush=True)


def hold(free_gb: float):
    import torch

    free, total = torch.cuda.mem_get_info()
    keep = int(free - free_gb * 1e9)
    block = torch.empty(keep, dtype=torch.uint8, device="cuda")
    block.fill_(1)
    print(json.dumps({"held": keep, "free_now": torch.cuda.mem_get_info()[0]}), flush=True)
    while True:
        time.sleep(60)


if __name__ == "__main__":
    what = sys.argv[1]
    if what == "run":
        args = sys.argv[2:] + ["auto", "48", "16"][len(sys.argv) - 3 :]
        run(args[0], args[1], int(args[2]), int(args[3]))
    elif what == "stock":
        stock(sys.argv[2], *(int(a) for a in sys.argv[3:5]))
    elif what == "hold":
        hold(float(sys.argv[2]))
