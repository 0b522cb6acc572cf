"""Run on each rank by `tests/test_pipeline.py` (through `mlx.launch`): load a model split over the ranks at
each capacity given, generate greedily from the prompts, and write what this rank did to OUT/rank<r>.json:
the tokens, its stage, the module paths of its MoE layers, every expert read by module path (recorded at
the store, load-time reads included), the bytes its slots hold, the names of the parameters it holds, and
what crossed the seam (`distributed/seams.py`: next-gate prefetch with the governor's precision check only, so
that it predicts every decode pass; the reads started before the hidden state came are counted). The seam
is ordered here: the next rank takes a prediction once it has started the pass before the one it is for,
and the rank before waits until it has (`seam_ack`): each comes in time, before the hidden state it is
for; a race between processes is not what is counted.

    pipeline_rank.py MODEL OUT CAPACITIES(comma) MAX_TOKENS PROMPTS(JSON)
"""

import json
import sys
import threading
import time
from collections import Counter
from pathlib import Path

from mlx.utils import tree_flatten

import od_moe
from od_moe.distributed import seams
from od_moe.distributed.rank_split import Handover
from od_moe.prefetch.governor import PrefetchSettings
from od_moe.storage.store import ExpertStore

model, out, capacities, max_tokens, prompts = sys.argv[1:6]
reads = Counter()
store_read = ExpertStore.read


def counted_read(self, layout, ids, staging):
    reads[layout.module_path] += len(ids) * layout.expert_nbytes
    return store_read(self, layout, ids, staging)


ExpertStore.read = counted_read
acks = threading.Semaphore(0)  # predictions the next rank has taken
send_prediction = seams.SeamSender.after_routing


def acked_after_routing(self, step, ids):
    sent = self.sent
    send_prediction(self, step, ids)
    if self.sent > sent and not acks.acquire(timeout=60):
        raise TimeoutError("the next rank did not take the seam's prediction in 60 s")


def taking(supervisor, receiver):
    def take(peer, message):
        # the rank before may be a pass ahead: the prompt's last token needs nothing from this rank
        deadline = time.monotonic() + 60
        while message["pass"] > receiver.passes.clock + 1 and time.monotonic() < deadline:
            time.sleep(0.001)
        receiver.on_message(peer, message)
        supervisor.send({"k": "seam_ack"}, to=peer)

    return take


seams.SeamSender.after_routing = acked_after_routing
runs = {}
for capacity in capacities.split(","):
    reads.clear()
    engine = od_moe.load(None if model == "-" else model, capacity=float(capacity))
    engine.configure_prefetch("next-gate", settings=PrefetchSettings(timed_checks=False))
    seams.watch(engine)
    supervisor = engine.stage.supervisor
    supervisor.handlers["seam_ack"] = lambda _peer, _message: acks.release()
    if engine.seam_receiver is not None:
        supervisor.handlers["seam"] = taking(supervisor, engine.seam_receiver)
    tokens = [
        [r.token for r in engine.stream_generate(p, max_tokens=int(max_tokens))] for p in json.loads(prompts)
    ]
    stats = engine.stats()
    runs[capacity] = {
        "tokens": tokens,
        "reads": dict(reads),
        "moe_paths": [c.layout.module_path for c in engine.caches],
        "expert_nbytes": [c.layout.expert_nbytes * c.num_experts for c in engine.caches],
        "slot_bytes": stats["memory"]["expert_cache_bytes"],
        "misses": stats["total"]["misses"],
        "parameters": [k for k, _ in tree_flatten(engine.model.parameters())],
        "seam_sent": policy.sent if isinstance(policy := engine.runtime.policy, seams.SeamSender) else None,
        "seam_received": engine.seam_receiver.counts if engine.seam_receiver is not None else None,
    }
    engine.close()
stage = engine.stage
handovers = sum(isinstance(m, Handover) for _, m in engine.model.named_modules())
Path(out, f"rank{stage.rank}.json").write_text(
    json.dumps(
        {
            "rank": stage.rank,
            "start": stage.start,
            "end": stage.end,
            "ranges": stage.ranges,
            "runs": runs,
            "handovers": handovers,
        }
    )
)
