"""Lab: where a two-tier engine's resident set peaks, past the host's memory. Loads MODEL with `--slots` C
device slots and `--host` H host rows a layer (direct I/O), then generates `--tokens`; a thread samples the
resident set every 5 ms with the main thread's stack. Prints the resident set after the load, the peak in
the load and in the generation, and the frames each peak was reached in. On MLX's CPU backend (and a Mac)
the slots are host memory too, so every copy a load or a fill makes shows here.

    python lab/three_tiers/load_memory.py MODEL [--slots 32] [--host 8] [--tokens 16]
"""

import argparse
import sys
import threading
import time
import traceback

import od_moe
from od_moe.two_tier.settings import TwoTierSettings


def resident() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS"):
            return int(line.split()[1]) * 1024
    return 0


class Sampler:
    """The resident set every 5 ms, with the main thread's innermost frames, until `stop`."""

    def __init__(self):
        self.main, self.samples, self.running = threading.get_ident(), [], True
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self):
        while self.running:
            frame = sys._current_frames().get(self.main)
            stack = traceback.extract_stack(frame)[-6:] if frame is not None else []
            where = [f"{s.filename.rsplit('/', 1)[-1]}:{s.lineno} {s.name}" for s in stack]
            self.samples.append((resident(), where))
            time.sleep(0.005)

    def take(self) -> list:
        taken, self.samples = self.samples, []
        return taken

    def stop(self):
        self.running = False
        self.thread.join()


def report(name: str, samples: list):
    peak, where = max(samples, key=lambda s: s[0])
    print(f"{name}: peak resident set {peak / 1e6:,.0f} MB, reached in")
    for frame in where:
        print(f"    {frame}")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--slots", type=int, default=32)
    parser.add_argument("--host", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=16)
    args = parser.parse_args()
    print(f"before the load: {resident() / 1e6:,.0f} MB")
    sampler = Sampler()
    settings = TwoTierSettings(host_experts=args.host)
    engine = od_moe.load(
        args.model, capacity=args.slots, two_tier=True, path_settings=settings, direct_io=True
    )
    loaded = sampler.take()
    per_row = len(engine.caches) * engine.caches[0].slot_nbytes / 1e6  # MB, a row of every layer
    print(
        f"after the load: {resident() / 1e6:,.0f} MB (slots {args.slots * per_row:,.0f} MB, host tier "
        f"{args.host * per_row:,.0f} MB in memory)"
    )
    list(engine.stream_generate("def parse(rows):", max_tokens=args.tokens))
    generated = sampler.take()
    sampler.stop()
    report("the load", loaded)
    report(f"{args.tokens} tokens", generated)


if __name__ == "__main__":
    main()
