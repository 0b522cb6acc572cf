"""Starting a script on several ranks of this machine with `mlx.launch` (ring backend over loopback), as the
pipeline tests and `lab/tools/pipeline_bench.py` do: a free port range for each launch (the launcher's default
port is fixed, and several test workers or users may launch at once), the od-moe being run on the ranks'
import path, and a deadline after which the whole process group is killed (a rank that died leaves the
others blocked in a collective: `mx.distributed` has no timeouts). `start` starts the ranks as the
launcher does but without it (the launcher stops every rank once one fails), so that the fault tests can
watch what a surviving rank does by itself. Not here: the pipeline (`rank_split.py`)."""

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parents[2]  # the folder od_moe is imported from


def free_ports(count: int) -> int:
    """The first of `count` consecutive loopback ports that are free now."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            first = s.getsockname()[1]
        if first + count > 65535:
            continue
        try:
            held = []
            for port in range(first, first + count):
                s = socket.socket()
                held.append(s)
                s.bind(("127.0.0.1", port))
            return first
        except OSError:
            continue
        finally:
            for s in held:
                s.close()
    raise RuntimeError("no free range of loopback ports")


def launch(script, args=(), ranks: int = 2, timeout: float = 240, extra_path=(), backend: str = "ring"):
    """Run `script args` on `ranks` ranks of this machine (`backend`: "ring" on loopback, or "nccl" over its
    GPUs), `extra_path` folders on their import path beside od-moe's; returns the CompletedProcess (stdout
    and stderr as text)."""
    path = _import_path(extra_path)
    command = [sys.executable, "-c", "from mlx._distributed_utils.launch import main; main()"]
    command += ["-n", str(ranks), "--backend", backend]
    command += ["--starting-port", str(free_ports(ranks)), "--env", f"PYTHONPATH={path}"]
    command += ["--python", sys.executable, str(script), *map(str, args)]
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        out, err = process.communicate()
        raise AssertionError(f"mlx.launch did not finish in {timeout} s:\n{out}\n{err}")
    return subprocess.CompletedProcess(command, process.returncode, out, err)


def start(script, args=(), ranks: int = 2, folder=None, extra_path=(), env=None) -> list[subprocess.Popen]:
    """Start `script args` as `ranks` processes of one ring group on loopback, as `mlx.launch` does (a
    hostfile in `folder`, MLX_RANK, MLX_HOSTFILE), each its own process group with stdout and stderr piped
    (text); `env`: more variables. The caller waits for them and kills them."""
    first = free_ports(ranks)
    hostfile = Path(folder or ".") / f"ranks-{first}.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{first + r}"] for r in range(ranks)]))
    path = _import_path(extra_path)
    common = dict(os.environ, PYTHONPATH=path, MLX_HOSTFILE=str(hostfile), **(env or {}))
    return [
        subprocess.Popen(
            [sys.executable, str(script), *map(str, args)],
            env=dict(common, MLX_RANK=str(r)),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        for r in range(ranks)
    ]


def _import_path(extra_path) -> str:
    """The ranks' PYTHONPATH: this checkout, `extra_path`, then the caller's own (where MLX may live)."""
    inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return os.pathsep.join(map(str, [CHECKOUT, *extra_path, *inherited]))
