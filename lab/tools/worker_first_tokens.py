"""Time to first token with no HTTP at all: 8 jobs handed to the server's generation worker at once (their
arrivals begun together, as a front end that read every request in parallel would hand them over), against
one job alone: the best any HTTP front end could give the serving benchmark's `ttft` rows.

    python3 lab/tools/worker_first_tokens.py [MODEL | bundled] [ROUNDS]

Per capacity (every expert resident, then 25%): medians over ROUNDS of the 8 prompts' median first-token
time, alone (one job at a time) and together; the ratio is together / alone. Greedy, 8 tokens a job.
"""

import statistics
import sys
import threading
import time

from staging_probe import NAMES  # the same 8 prompt heads (a tool beside this one)

import od_moe
from od_moe.server.requests import GenerationParams
from od_moe.server.worker import GenerationWorker


def first_tokens(worker, prompts, params) -> list[float]:
    """Seconds from handing `prompts` over together to each one's first event."""
    arrivals = [worker.arrivals.begin() for _ in prompts]
    t0 = time.perf_counter()
    jobs = [worker.submit(p, params, arrival=a) for p, a in zip(prompts, arrivals)]
    out = [0.0] * len(jobs)

    def wait(i, job):
        job.events.get()
        out[i] = time.perf_counter() - t0
        while job.events.get()[0] == "text":
            pass

    threads = [threading.Thread(target=wait, args=(i, j)) for i, j in enumerate(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def main():
    model = sys.argv[1] if len(sys.argv) > 1 and sys.argv[1] != "bundled" else None
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 6
    for capacity in (None, "25%"):
        engine = od_moe.load(model, capacity=capacity)
        prompts = [engine.tokenizer.encode(f"def {n}(") for n in NAMES]
        worker = GenerationWorker(engine, max_batch=len(prompts))
        worker.ready.wait()
        params = GenerationParams(max_tokens=8, temperature=0.0, stream=True)
        first_tokens(worker, prompts[:1], params)  # kernels and shapes, then the batch's
        first_tokens(worker, prompts, params)
        alone, together = [], []
        for _ in range(rounds):
            alone.append(statistics.median(first_tokens(worker, [p], params)[0] for p in prompts))
            together.append(statistics.median(first_tokens(worker, prompts, params)))
        a, t = statistics.median(alone), statistics.median(together)
        ratios = [round(x / y, 2) for x, y in zip(together, alone)]
        print(
            f"{engine.mode.path:>9} capacity {capacity or 'all'}: alone {a * 1e3:.1f} ms, 8 together "
            f"{t * 1e3:.1f} ms, ratio {t / a:.2f}x (rounds {ratios})"
        )
        worker.shutdown()


if __name__ == "__main__":
    main()
