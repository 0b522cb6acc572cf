"""The host's time a call of `mx.fast.cuda_kernel` by what the call carries: the source's length, its
inputs and its outputs. 400 chained calls of a kernel whose one thread writes one element, built then
evaluated at once: the evaluation's wall time a call is the host's encoding (the kernels are trivial).

    python3 lab/tools/custom_kernel_host.py

Not a test or a bench: a measurement for docs/GPU.md ("Real shapes' tokens"). CUDA only.
"""

import time

import mlx.core as mx

BODY = "if (threadIdx.x == 0 && blockIdx.x == 0) out0[0] = a0[0] + 1.0f;\n"


def us_a_call(step, calls: int = 400) -> float:
    """`calls` chained `x = step(x)` built, then evaluated at once: the evaluation's wall time a call (best
    of 3), in microseconds."""
    best = float("inf")
    for _ in range(3):
        x = mx.zeros((8,), mx.float32)
        mx.eval(x)
        for _ in range(calls):
            x = step(x)
        start = time.perf_counter()
        mx.eval(x)
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e6


def per_call(inputs: int, outputs: int, padding: int) -> float:
    names = [f"a{i}" for i in range(inputs)]
    outs = [f"out{i}" for i in range(outputs)]
    source = BODY + "".join(f"out{i}[0] = 0.0f;\n" for i in range(1, outputs)) + "// " + "x" * padding + "\n"
    kernel = mx.fast.cuda_kernel(
        name=f"host_{inputs}_{outputs}_{padding}", input_names=names, output_names=outs, source=source
    )
    rest = [mx.zeros((8,), mx.float32) for _ in range(inputs - 1)]
    mx.eval(rest)
    return us_a_call(
        lambda x: kernel(
            inputs=[x, *rest],
            grid=(32, 1, 1),
            threadgroup=(32, 1, 1),
            output_shapes=[(8,)] * outputs,
            output_dtypes=[mx.float32] * outputs,
        )[0]
    )


def main():
    print(f"MLX's own add (the baseline): {us_a_call(lambda x: x + 1.0):6.1f} us a call evaluated")
    for inputs, outputs, padding in [
        (1, 1, 0),
        (1, 1, 11000),
        (16, 1, 0),
        (1, 8, 0),
        (16, 8, 0),
        (16, 8, 11000),
    ]:
        print(
            f"{inputs:2d} inputs, {outputs} outputs, source +{padding:5d} bytes: "
            f"{per_call(inputs, outputs, padding):6.1f} us a call evaluated"
        )


if __name__ == "__main__":
    main()
