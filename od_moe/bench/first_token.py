"""Time to first token through the server, run by hand: `python3 -m od_moe.bench.serving ttft`.

`--prompts` greedy streamed requests (8 by default), on a server at `--max-batch` over the embedded model,
every expert resident and at 25%: each sent alone (one after another, the server idle between them) and
all sent at once (their client threads released by one barrier), `--rounds` rounds alternating which goes
first. A request's time to first token is measured by its client: from sending the request to the first
streamed chunk carrying text. The clients run in a process of their own (`client_process.py`), as a
server's clients do; `same_process` puts them on threads of the server's process, as this benchmark did
before, where they and the server's threads wait on one GIL. The table gives the medians, their ratio,
the worst "together" request, how many prefill groups the together requests were admitted in (1: every
prompt joined the batch before the same step, so mlx-lm's `BatchGenerator` prefilled them in one batch),
the steps from joining to the first token, and whether each answer was the same text alone and together.
Beside them, the floor no schedule beats with mlx-lm's arithmetic on this machine: stock mlx-lm's own
`BatchGenerator` in this process (no HTTP, no server), the same prompts inserted one at a time and all at
once, time from insertion to each sequence's first token, and whether each answer (`max_tokens` greedy
tokens) was the same alone and together: a batch runs other GEMM shapes, which may round differently, so
stock's own count is what the server's "same text" is read against. Where compute is the limit (a CPU,
where a prefill of 8 prompts costs nearly 8 of one: docs/BENCHMARKS.md, "The server under many clients"),
"together" cannot come near "alone" however the steps are arranged.
`model` serves another checkpoint (the benchmark's `--widen` copy: experts as large as a big model's,
where a prompt's expert reads, not the host, set its time).
Not here: the server's other benchmarks (`serving.py`).
"""

import contextlib
import statistics
import sys
import time

from mlx_lm.generate import BatchGenerator

from ..engine import DEFAULT_MODEL
from . import client_process
from .batch_speed import batch_prompts
from .clients import start_server
from .foundation import stock_model


def ttft(
    prompts: int,
    rounds: int,
    max_tokens: int,
    max_batch: int,
    capacities=(None, "25%"),
    model=None,
    same_process: bool = False,
    switch_intervals=(None,),
) -> dict:
    """Median time to first token of `prompts` greedy streamed requests alone and arriving together, on a
    server over `model` (the embedded one by default) at each capacity (None: every expert resident) and
    each of `switch_intervals` (the interpreter's, `sys.setswitchinterval`; None: the server's own), and
    stock mlx-lm's floor. The clients run in a process of their own unless `same_process`."""
    texts = batch_prompts(prompts)
    rows = []
    for capacity in capacities:
        for interval in switch_intervals:
            kept = sys.getswitchinterval()
            clients = (
                contextlib.nullcontext(client_process) if same_process else client_process.ClientProcess()
            )
            try:
                with clients as send:
                    rows.append(
                        _server_row(texts, rounds, max_tokens, max_batch, capacity, model, send, interval)
                    )
            finally:
                sys.setswitchinterval(kept)
    return {
        "model": str(model or DEFAULT_MODEL),
        "prompts": prompts,
        "rounds": rounds,
        "max_tokens": max_tokens,
        "max_batch": max_batch,
        "clients": "the server's process" if same_process else "a process of their own",
        "rows": rows,
        "stock": stock_floor(texts, rounds, max_batch, model=model or DEFAULT_MODEL, max_tokens=max_tokens),
    }


def _server_row(
    texts: list[str], rounds: int, max_tokens: int, max_batch: int, capacity, model, clients, interval
) -> dict:
    """One server's row; `clients.first_tokens(base, bodies, together)` sends the requests (this process's
    threads, or a `ClientProcess`)."""
    base, log, server, app = start_server(capacity, max_batch, model)
    if interval is not None:
        sys.setswitchinterval(interval)
    clients.first_tokens(base, [{"prompt": texts[0], "max_tokens": 2, "temperature": 0}], False)  # warm up
    bodies = [{"prompt": t, "max_tokens": max_tokens, "temperature": 0} for t in texts]
    seconds: dict[str, list[float]] = {"alone": [], "together": []}
    answers: dict[str, dict[int, str]] = {"alone": {}, "together": {}}
    groups, steps, throughput = [], [], []
    for r in range(rounds):
        for how in ("alone", "together") if r % 2 == 0 else ("together", "alone"):
            joined = len(log.joins)
            got = clients.first_tokens(base, bodies, together=how == "together")
            seconds[how] += [g[0] for g in got]
            answers[how].update({i: g[1] for i, g in enumerate(got)})
            if how == "together":
                throughput.append(sum(g[2] for g in got) / max(g[3] for g in got))
            if how == "together" and app.worker.batch is not None:
                joins = log.joins[joined:]
                groups.append(len({j.step for j in joins}))
                steps += [log.token_steps[j.uid][0] - j.step for j in joins if log.token_steps[j.uid]]
    server.shutdown()
    app.worker.shutdown()
    alone_s, together_s = (statistics.median(seconds[k]) for k in ("alone", "together"))
    return {
        "capacity": app.worker.engine.capacity,
        "switch_interval_s": sys.getswitchinterval(),
        "alone_s": alone_s,
        "together_s": together_s,
        "ratio": together_s / alone_s,
        "together_max_s": max(seconds["together"]),
        "prefill_groups": statistics.mean(groups) if groups else None,
        "steps_to_first_token": statistics.median(steps) if steps else None,
        "together_tok_s": statistics.median(throughput),
        "same_text": sum(answers["alone"][i] == answers["together"][i] for i in answers["alone"]),
        "seconds": {k: [round(s, 4) for s in v] for k, v in seconds.items()},
    }


def stock_floor(
    texts: list[str],
    rounds: int,
    max_batch: int,
    prefill_step: int = 256,
    model=DEFAULT_MODEL,
    max_tokens: int = 2,
) -> dict:
    """Stock mlx-lm's `BatchGenerator` (the server's settings) in this process, every expert of `model`
    resident: the median seconds from inserting each prompt to its first token, one prompt at a time and
    all at once, and how many prompts got the same `max_tokens` greedy tokens both ways (the last round's
    answers, as the server's rows compare)."""
    model, tokenizer = stock_model(model)
    prompts = [tokenizer.encode(t) for t in texts]
    stop_tokens = [[t] for t in tokenizer.eos_token_ids]

    def generate(group: list[list[int]], limit: int) -> tuple[list[float], list[list[int]]]:
        """Each sequence's seconds to its first token, and its tokens, in `group`'s order."""
        generator = BatchGenerator(
            model,
            stop_tokens=stop_tokens,
            completion_batch_size=max_batch,
            prefill_batch_size=min(max_batch, 8),
            prefill_step_size=prefill_step,
        )
        started = time.perf_counter()
        uids: list[int] = generator.insert(group, [limit] * len(group))
        first: dict[int, float] = {}
        done: set[int] = set()
        tokens: dict[int, list[int]] = {uid: [] for uid in uids}
        while len(done) < len(uids):
            for r in generator.next()[1]:
                first.setdefault(r.uid, time.perf_counter() - started)
                tokens[r.uid].append(r.token)
                if r.finish_reason is not None:
                    done.add(r.uid)
        generator.close()
        return [first[uid] for uid in uids], [tokens[uid] for uid in uids]

    generate(prompts[:1], 2)  # warm up
    seconds: dict[str, list[float]] = {"alone": [], "together": []}
    answers: dict[str, list[list[int]]] = {"alone": [], "together": []}
    for r in range(rounds):
        for how in ("alone", "together") if r % 2 == 0 else ("together", "alone"):
            groups = [[p] for p in prompts] if how == "alone" else [prompts]
            got = [generate(g, max_tokens) for g in groups]
            seconds[how] += [s for g in got for s in g[0]]
            answers[how] = [t for g in got for t in g[1]]
    alone_s, together_s = (statistics.median(seconds[k]) for k in ("alone", "together"))
    return {
        "alone_s": alone_s,
        "together_s": together_s,
        "ratio": together_s / alone_s,
        "same_text": sum(a == t for a, t in zip(answers["alone"], answers["together"])),
    }


def ttft_table(report: dict) -> str:
    """The report as a table, milliseconds."""
    lines = [
        f"time to first token, {report['prompts']} greedy streamed requests, medians over {report['rounds']} "
        f"rounds ({report['max_tokens']} tokens each, --max-batch {report['max_batch']}), clients in "
        f"{report['clients']}, {report['model']}",
        f"{'':>27} {'switch':>6} {'alone':>8} {'together':>8} {'ratio':>6} {'worst':>8} {'groups':>6} "
        f"{'steps':>5} {'tok/s':>6} {'same text':>9}",
    ]
    for row in report["rows"]:
        groups, steps = row["prefill_groups"], row["steps_to_first_token"]
        lines.append(
            f"{'server, ' + str(row['capacity']) + ' experts resident':>27} "
            f"{row['switch_interval_s'] * 1e3:>4.1f}ms {row['alone_s'] * 1e3:>6.1f}ms "
            f"{row['together_s'] * 1e3:>6.1f}ms {row['ratio']:>5.2f}x {row['together_max_s'] * 1e3:>6.1f}ms "
            f"{'-' if groups is None else f'{groups:.1f}':>6} {'-' if steps is None else steps:>5} "
            f"{row['together_tok_s']:>6.1f} "
            f"{row['same_text']:>6}/{report['prompts']}"
        )
    stock = report["stock"]
    lines.append(
        f"{'stock BatchGenerator, floor':>27} {'':>6} {stock['alone_s'] * 1e3:>6.1f}ms "
        f"{stock['together_s'] * 1e3:>6.1f}ms {stock['ratio']:>5.2f}x {'':>8} {'':>6} {'':>5} {'':>6} "
        f"{stock['same_text']:>6}/{report['prompts']}"
    )
    return "\n".join(lines)
