"""Run on each rank by `tests/test_pipeline_faults.py` (started without `mlx.launch`): the `od-moe` command
line given, where rank DIE_RANK ends itself once it has generated DIE_AFTER tokens (all requests together),
with SIGKILL (`DIE_HOW=kill`: its process ends, its sockets close) or SIGSTOP (`stop`: it stays, silent, as
a hung process or a machine gone from the network would), first printing `dies at <time>` to stderr.

    dying_rank.py OD-MOE-ARGUMENTS...
"""

import os
import signal
import sys
import time

from od_moe.cli import main
from od_moe.engine import Engine

generate, generated = Engine.stream_generate, [0]


def dying(self, *args, **kwargs):
    for response in generate(self, *args, **kwargs):
        generated[0] += 1
        if self.stage.rank == int(os.environ["DIE_RANK"]) and generated[0] == int(os.environ["DIE_AFTER"]):
            print(f"dies at {time.time()}", file=sys.stderr, flush=True)
            os.kill(os.getpid(), signal.SIGKILL if os.environ["DIE_HOW"] == "kill" else signal.SIGSTOP)
        yield response


Engine.stream_generate = dying
sys.exit(main(sys.argv[1:]))
