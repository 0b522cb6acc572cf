"""Run on each rank by `tests/test_pipeline.py` (through `mlx.launch`): load a model split over the ranks at
each capacity given, generate greedily from the prompts, and write what this rank did to OUT/rank<r>.json:
the tokens, its stage, the module paths of its MoE layers, every expert read by module path (recorded at
the store, load-time reads included), the bytes its slots hold, the names of the parameters it holds, and
what crossed the seam (`distributed/seams.py`: next-gate prefetch with the governor's precision check only, so
that it predicts every decode pass; the reads started before the hidden state came are counted).

    pipeline_rank.py MODEL OUT CAPACITIES(comma) MAX_TOKENS PROMPTS(JSON)
"""

import json
import sys
from collections import Counter
from pathlib import Path

from mlx.utils import tree_flatten

import od_moe
from od_moe.distributed import seams
from od_moe.distributed.rank_split import Handover
from od_moe.per_layer.governor import PrefetchSettings
from od_moe.store import ExpertStore

model, out, capacities, max_tokens, prompts = sys.argv[1:6]
reads = Counter()
store_read = ExpertStore.read


def counted_read(self, layout, ids, staging):
    reads[layout.module_path] += len(ids) * layout.expert_nbytes
    return store_read(self, layout, ids, staging)


ExpertStore.read = counted_read
runs = {}
for capacity in capacities.split(","):
    reads.clear()
    engine = od_moe.load(None if model == "-" else model, capacity=float(capacity))
    engine.configure_prefetch("next-gate", settings=PrefetchSettings(timed_checks=False))
    seams.watch(engine)
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
