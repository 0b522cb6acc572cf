"""Lab: how long a layer waits for N experts read from disk (O_DIRECT) on `--threads` reader threads, each
way of `--spans` alternating on random (layer, experts) draws: 0 reads an expert as one request a part by
one thread (as three tiers read before 17bb199), B > 0 cuts its bytes into requests of at most B bytes run
at once (`ExpertStore.spans`, `TwoTierSettings.disk_span`). Prints the median ms a draw and GB/s per way:
whether a single expert's read, what a layer that waits for its routing waits for, gains from more
requests in flight on this disk.

    python lab/three_tiers/span_reads.py MODEL [--experts 1,2,4] [--draws 60] [--spans 0,524288]
        [--threads 8]
"""

import argparse
import statistics
import time
from concurrent.futures import ThreadPoolExecutor, wait

import numpy as np

from od_moe.engine import model_layouts
from od_moe.storage.layout import ExpertRows
from od_moe.two_tier.settings import DISK_SPAN


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--experts", default="1,2,4")
    parser.add_argument("--draws", type=int, default=60)
    parser.add_argument("--spans", default=f"0,{DISK_SPAN}", help="request sizes in bytes (0: whole parts)")
    parser.add_argument("--threads", type=int, default=8)
    args = parser.parse_args()
    store, layouts = model_layouts(args.model)
    print("direct I/O", store.use_direct_io(True), "refused:", store.direct_io_refused)
    pool = ThreadPoolExecutor(args.threads)
    rng = np.random.default_rng(0)

    def read(span: int, layout, ids):
        if not span:
            return [pool.submit(store.read, layout, [e], ExpertRows(layout, 1)) for e in ids]
        futures = []
        for e in ids:
            for part in store.spans(layout, e, ExpertRows(layout, 1), span):
                futures.append(pool.submit(store.read_span, layout, e, part))
        return futures

    ways = [int(s) for s in args.spans.split(",")]
    for n in [int(x) for x in args.experts.split(",")]:
        times: dict[int, list[float]] = {span: [] for span in ways}
        for _ in range(args.draws):
            layer = int(rng.integers(len(layouts)))
            ids = rng.choice(layouts[layer].num_experts, size=n, replace=False).tolist()
            for span in rng.permutation(ways).tolist():
                t0 = time.perf_counter()
                wait(read(span, layouts[layer], ids))
                times[span].append(time.perf_counter() - t0)
        nbytes = n * layouts[0].expert_nbytes
        print(
            f"{n} experts, {args.threads} threads: "
            + ", ".join(
                f"{'whole' if span == 0 else f'{span // 1024} KB'} {statistics.median(v) * 1e3:.2f} ms"
                f" ({nbytes / statistics.median(v) / 1e9:.2f} GB/s)"
                for span, v in times.items()
            )
        )


if __name__ == "__main__":
    main()
