"""How long a surviving rank takes to stop once another dies mid-generation (issue #39,
`distributed/heartbeat.py`).

Two loopback ranks run `od-moe generate` (the bundled model, 25%, 200 tokens), started without `mlx.launch`
(which would stop the survivor itself); `tests/dying_rank.py` ends one rank at its 4th token, by SIGKILL (its
process ends, its sockets close) or SIGSTOP (it stays, silent: a hung process, or a machine gone from the
network). Per case: the survivor's exit code, its last line, and the seconds from the death to its exit.

    python lab/tools/pipeline_faults.py [--timeout 3]   # OD_MOE_HEARTBEAT_TIMEOUT for the silent cases
"""

import argparse
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

HOOK = Path(__file__).resolve().parents[2] / "tests" / "dying_rank.py"
ARGS = ["generate", "--prompt", "def fibonacci(n):", "--ignore-chat-template", "--max-tokens", 200]


def case(dying: int, how: str, timeout: str, folder: str) -> str:
    from od_moe.distributed.local_ranks import start

    env = dict(DIE_RANK=str(dying), DIE_AFTER="4", DIE_HOW=how, OD_MOE_HEARTBEAT_TIMEOUT=timeout)
    ranks = start(HOOK, [*ARGS, "--capacity", "25%"], folder=folder, env=env)
    survivor = ranks[1 - dying]
    try:
        _, err = survivor.communicate(timeout=600)
        ended = time.time()
        _, dead_err = ranks[dying].communicate(timeout=1) if how == "kill" else ("", "")
    except Exception:
        dead_err = ""
    finally:
        for p in ranks:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        for p in ranks:
            p.wait()
    if how == "stop":
        dead_err = ranks[dying].stderr.read()
    died = float(next(line for line in dead_err.splitlines() if "dies at " in line).split("dies at ")[1])
    last = err.strip().splitlines()[-1]
    return (
        f"rank {dying} {'killed' if how == 'kill' else 'stopped'} (heartbeat timeout {timeout} s): rank "
        f"{1 - dying} exited with {survivor.returncode} after {ended - died:.2f} s: {last}"
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--timeout", default="3")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        for dying, how in ((1, "kill"), (0, "kill"), (1, "stop"), (0, "stop")):
            print(case(dying, how, args.timeout, folder), flush=True)
    sys.exit(0)


if __name__ == "__main__":
    main()
