"""Lab: how much the reader threads' O_DIRECT span reads slow a Python loop on the main thread (MLX's
thread builds each layer in Python and needs the GIL). Counts the loop's iterations in 1 s windows with
no readers, then with 8 reader threads reading random experts' spans back to back; prints both and the
readers' GB/s. Run it at two commits to compare how the readers copy out of the bounce buffer.

    python lab/three_tiers/reader_gil.py MODEL [--windows 5]
"""

import argparse
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from od_moe.engine import model_layouts
from od_moe.storage.layout import ExpertRows
from od_moe.two_tier.settings import DISK_SPAN


def spin(seconds: float) -> int:
    """Iterations of an empty Python loop in `seconds`."""
    start, n = time.perf_counter(), 0
    while time.perf_counter() - start < seconds:
        n += 1
    return n


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--windows", type=int, default=5)
    args = parser.parse_args()
    store, layouts = model_layouts(args.model)
    print("direct I/O", store.use_direct_io(True), "refused:", store.direct_io_refused)
    stop, read = threading.Event(), [0]

    def reader(seed: int):
        rng = np.random.default_rng(seed)
        while not stop.is_set():
            layout = layouts[int(rng.integers(len(layouts)))]
            expert = int(rng.integers(layout.num_experts))
            rows = ExpertRows(layout, 1)
            for span in store.spans(layout, expert, rows, DISK_SPAN):
                store.read_span(layout, expert, span)
                read[0] += len(span.view)

    alone = [spin(1.0) for _ in range(args.windows)]
    pool = ThreadPoolExecutor(8)
    for seed in range(8):
        pool.submit(reader, seed)
    time.sleep(0.2)
    start, before = time.perf_counter(), read[0]
    busy = [spin(1.0) for _ in range(args.windows)]
    rate = (read[0] - before) / (time.perf_counter() - start) / 1e9
    stop.set()
    pool.shutdown()
    a, b = statistics.median(alone), statistics.median(busy)
    print(
        f"loop iterations a second: alone {a:,.0f}, with 8 readers {b:,.0f} ({b / a:.2f}x); "
        f"readers {rate:.2f} GB/s"
    )


if __name__ == "__main__":
    main()
