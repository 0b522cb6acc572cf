"""Lab: how long a layer waits for N experts read from disk (O_DIRECT) on 8 reader threads, read as one
request a part by one thread an expert (as three tiers read before 17bb199) or as `ExpertStore.spans` run
at once (after). Alternates the two on random (layer, experts) draws; prints the median ms a draw and GB/s.

    python lab/three_tiers/span_reads.py MODEL [--experts 1,2,4] [--draws 60]
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
    args = parser.parse_args()
    store, layouts = model_layouts(args.model)
    print("direct I/O", store.use_direct_io(True), "refused:", store.direct_io_refused)
    pool = ThreadPoolExecutor(8)
    rng = np.random.default_rng(0)

    def whole(layout, ids):
        return [pool.submit(store.read, layout, [e], ExpertRows(layout, 1)) for e in ids]

    def spans(layout, ids):
        futures = []
        for e in ids:
            for span in store.spans(layout, e, ExpertRows(layout, 1), DISK_SPAN):
                futures.append(pool.submit(store.read_span, layout, e, span))
        return futures

    for n in [int(x) for x in args.experts.split(",")]:
        times = {"whole": [], "spans": []}
        for _ in range(args.draws):
            layer = int(rng.integers(len(layouts)))
            ids = rng.choice(layouts[layer].num_experts, size=n, replace=False).tolist()
            for name, way in (
                (("whole", whole), ("spans", spans))
                if rng.random() < 0.5
                else (("spans", spans), ("whole", whole))
            ):
                t0 = time.perf_counter()
                wait(way(layouts[layer], ids))
                times[name].append(time.perf_counter() - t0)
        nbytes = n * layouts[0].expert_nbytes
        print(
            f"{n} experts: "
            + ", ".join(
                f"{k} {statistics.median(v) * 1e3:.2f} ms ({nbytes / statistics.median(v) / 1e9:.2f} GB/s)"
                for k, v in times.items()
            )
        )


if __name__ == "__main__":
    main()
