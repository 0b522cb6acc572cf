"""Lab: where the driver's count of a process goes after a 4k-token prompt (not product code).

`od MODEL CAPACITY`: od_moe.load, then a 4,096-token prompt and one token, then `mx.clear_cache()`;
`stock MODEL`: the same with stock mlx-lm; `ops HEADS KV_HEADS`: no model, only attention over a
2,048-token chunk of a 4,352-token context and a 4-bit matmul of 2,048 rows (the libraries' own memory).
After each step one JSON line: the card's use by this process (free at start minus free now, plus the
CUDA context), NVML's count (device allocations, not managed memory), MLX's active and cache counters.

  python3 lab/device_memory/attribute.py od MODEL 25% | stock MODEL | ops 32 4
"""

import json
import os
import sys


def main():
    import mlx.core as mx

    from od_moe.memory import cuda

    free0 = cuda.memory_info()[0]
    context = cuda.process_device_bytes(os.getpid())

    def note(step, **more):
        use = free0 - cuda.memory_info()[0] + context
        nvml = cuda.process_device_bytes(os.getpid())
        line = {"step": step, "card_use": use, "nvml": nvml, "active": mx.get_active_memory()}
        line.update(cache=mx.get_cache_memory(), **more)
        print(
            json.dumps({k: round(v / 1e9, 3) if isinstance(v, int) else v for k, v in line.items()}),
            flush=True,
        )

    note("context")
    what = sys.argv[1]
    if what == "ops":
        heads, kv_heads = int(sys.argv[2]), int(sys.argv[3])
        q = mx.random.normal((1, heads, 2048, 128)).astype(mx.bfloat16)
        k = mx.random.normal((1, kv_heads, 4352, 128)).astype(mx.bfloat16)
        mx.eval(q, k)
        note("inputs")
        o = mx.fast.scaled_dot_product_attention(q, k, k, scale=0.088, mask="causal")
        mx.eval(o)
        note("attention")
        w = mx.random.normal((2048, 2048)).astype(mx.bfloat16)
        wq, s, b = mx.quantize(w, group_size=64, bits=4)
        x = mx.random.normal((2048, 2048)).astype(mx.bfloat16)
        mx.eval(mx.quantized_matmul(x, wq, s, b, transpose=True, group_size=64, bits=4))
        note("qmm")
        del o
        mx.clear_cache()
        note("cleared")
        return
    model = sys.argv[2]
    if what == "od":
        import od_moe

        engine = od_moe.load(model, capacity=sys.argv[3])
        note("loaded", capacity=engine.capacity)
        tokenizer, gen = engine.tokenizer, lambda p, n: list(engine.stream_generate(p, max_tokens=n))
    else:
        from mlx_lm import load, stream_generate

        m, tokenizer = load(model)
        mx.eval(m.parameters())
        note("loaded")
        gen = lambda p, n: list(stream_generate(m, tokenizer, p, max_tokens=n))  # noqa: E731
    ids = []
    while len(ids) < 4096:
        ids += tokenizer.encode(
            "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n\n"
        )
    prompt = tokenizer.decode(ids[:4096])
    gen("def f(x):", 4)
    note("short prompt, 4 tokens")
    gen(prompt, 1)
    note("4k prompt, 1 token")
    mx.clear_cache()
    note("cleared")
    gen(prompt, 1)
    note("4k prompt again, 1 token")
    mx.clear_cache()
    note("cleared")


if __name__ == "__main__":
    main()
