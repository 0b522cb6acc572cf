"""Lab: does a command stay within a host memory budget? Runs it and samples, every 0.1 s, its process tree's
resident set (/proc/PID/status VmRSS, and VmHWM at the end) and the machine's page cache (/proc/meminfo
Cached, its growth since the start), and reads /proc/PID/io (bytes the tree read from storage, and through
read calls). Where this machine lets a cgroup v2 group be made (`/sys/fs/cgroup`, memory controller), the
command runs in one with memory.max set to the budget and its memory.peak is reported as well. `--files
DIR`: the checkpoint's files are dropped from the page cache first (sync, then POSIX_FADV_DONTNEED: clean
pages go) and how many of their bytes are in the page cache after the run is counted (mincore): the copy
the run left there.

    python lab/three_tiers/within_budget.py --budget 9GB --files MODEL --json out.json -- od-moe generate ...

Prints one JSON object: peak RSS, peak cache growth, their peak sum against the budget, the io counts,
the cgroup's verdict where there was one, the command's exit code, and a timeline every 0.5 s (resident
set in anonymous, file-backed and shared pages, cache growth, bytes read) to say when memory grew.
"""

import argparse
import ctypes
import json
import mmap
import os
import subprocess
import sys
import time
from pathlib import Path

UNITS = {"GB": 10**9, "GIB": 2**30, "MB": 10**6, "MIB": 2**20}


def size(text: str) -> int:
    for unit, factor in UNITS.items():
        if text.upper().endswith(unit):
            return int(float(text[: -len(unit)]) * factor)
    return int(text)


def meminfo(key: str) -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return 0


def tree(pid: int) -> list[int]:
    """`pid` and its descendants."""
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        found.append(p)
        try:
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return found


def status(pid: int, key: str) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def io(pid: int) -> dict:
    try:
        return {
            k: int(v) for k, v in (ln.split(": ") for ln in Path(f"/proc/{pid}/io").read_text().splitlines())
        }
    except OSError:
        return {}


def drop_from_cache(folder: Path):
    os.sync()
    for f in folder.rglob("*"):
        if f.is_file():
            fd = os.open(f, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def cached_bytes(folder: Path) -> int:
    """Bytes of the files under `folder` in the page cache (mincore over a map of each)."""
    libc = ctypes.CDLL(None, use_errno=True)
    c = ctypes
    map_file = c.CFUNCTYPE(c.c_void_p, c.c_void_p, c.c_size_t, c.c_int, c.c_int, c.c_int, c.c_long)(
        ("mmap", libc)
    )
    mincore = c.CFUNCTYPE(c.c_int, c.c_void_p, c.c_size_t, c.c_void_p, use_errno=True)(("mincore", libc))
    munmap = c.CFUNCTYPE(c.c_int, c.c_void_p, c.c_size_t)(("munmap", libc))
    page, total = mmap.PAGESIZE, 0
    for f in folder.rglob("*"):
        length = f.stat().st_size if f.is_file() else 0
        if not length:
            continue
        fd = os.open(f, os.O_RDONLY)
        try:
            address = map_file(None, length, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            if address in (None, ctypes.c_void_p(-1).value):
                raise OSError(ctypes.get_errno(), f"mmap {f}")
            vec = (ctypes.c_ubyte * ((length + page - 1) // page))()
            if mincore(address, length, vec) != 0:
                raise OSError(ctypes.get_errno(), f"mincore {f}")
            munmap(address, length)
            total += sum(v & 1 for v in vec) * page
        finally:
            os.close(fd)
    return total


def cgroup(budget: int) -> Path | None:
    """A cgroup v2 group with memory.max = `budget`, or None where the machine does not allow one."""
    root = Path("/sys/fs/cgroup")
    try:
        if "memory" not in (root / "cgroup.controllers").read_text().split():
            return None
        (root / "cgroup.subtree_control").write_text("+memory")
        group = root / f"od-moe-budget-{os.getpid()}"
        group.mkdir()
        (group / "memory.max").write_text(str(budget))
        return group
    except OSError:
        return None


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--budget", required=True, help="e.g. 9GB")
    parser.add_argument("--json")
    parser.add_argument(
        "--files", help="the checkpoint's folder: dropped from the page cache first, counted after"
    )
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    budget = size(args.budget)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    group = cgroup(budget)
    files = Path(args.files) if args.files else None
    if files is not None:
        drop_from_cache(files)
    files_before = cached_bytes(files) if files is not None else None
    cached0 = meminfo("Cached")
    # the child joins the group before it runs anything, so everything it maps is charged to it
    join = (lambda: (group / "cgroup.procs").write_text(str(os.getpid()))) if group else None
    child = subprocess.Popen(command, preexec_fn=join)
    peak = dict(rss=0, cache=0, total=0)
    last_io: dict[int, dict] = {}
    hwm, timeline, start, noted = 0, [], time.monotonic(), -1.0
    while child.poll() is None:
        pids = tree(child.pid)
        rss = sum(status(p, "VmRSS") for p in pids)
        hwm = max(hwm, status(child.pid, "VmHWM"))
        cache = meminfo("Cached") - cached0
        for p in pids:
            last_io[p] = io(p) or last_io.get(p, {})
        now = time.monotonic() - start
        if now - noted >= 0.5:  # where the memory goes, and when: anonymous, file-backed, shared pages
            noted = now
            parts = {k: sum(status(p, k) for p in pids) for k in ("RssAnon", "RssFile", "RssShmem")}
            read = sum(last_io.get(p, {}).get("read_bytes", 0) for p in pids)
            timeline.append(dict(t=round(now, 1), rss=rss, cache=cache, read_bytes=read, **parts))
        peak = dict(
            rss=max(peak["rss"], rss),
            cache=max(peak["cache"], cache),
            total=max(peak["total"], rss + max(cache, 0)),
        )
        time.sleep(0.1)
    counts = {k: sum(d.get(k, 0) for d in last_io.values()) for k in ("rchar", "read_bytes")}
    report = {
        "command": command,
        "exit_code": child.returncode,
        "budget": budget,
        "peak_rss": peak["rss"],
        "vm_hwm": hwm,
        "peak_cache_growth": peak["cache"],
        "peak_rss_plus_cache_growth": peak["total"],
        "within_budget": peak["total"] <= budget,
        "io": counts,
        "checkpoint_cached_before": files_before,
        "checkpoint_cached_after": cached_bytes(files) if files is not None else None,
        "cgroup": None,
        "timeline": timeline,
    }
    if group is not None:
        read = lambda name: (group / name).read_text().strip() if (group / name).exists() else None  # noqa: E731
        report["cgroup"] = {"memory.max": read("memory.max"), "memory.peak": read("memory.peak")}
        report["cgroup"]["events"] = read("memory.events")
        try:
            group.rmdir()
        except OSError:
            pass
    text = json.dumps(report, indent=1)
    print(text)
    if args.json:
        Path(args.json).write_text(text)
    sys.exit(0 if child.returncode == 0 else 1)


if __name__ == "__main__":
    main()
