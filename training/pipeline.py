"""The two predictor jobs behind the CLI: `train_predictor_job` (record traces, train, evaluate, save,
report) and `eval_predictor_job` (record traces of any text and evaluate any predictor on them).

Traces are recorded into `traces_dir` (default: a `traces` folder in the output, removed afterwards unless
kept); a folder that already holds traces recorded from the same model and data for the same token limit is
reused instead of recorded again. Not here: argument parsing (`od_moe/cli.py`) or printing
(`accounting/report.py`).
"""

import json
import shutil
import tempfile
import time
from pathlib import Path

import mlx.core as mx

from ..errors import UserError
from ..predictor.model import PredictorConfig, ShadowPredictor, load_predictor
from .data import Documents, load_documents, split_documents
from .evaluate import baselines, evaluate_predictor, eviction_replay, predictor_latency_ms
from .next_use import fit_next_use, trace_distances
from .record import TraceSet, record_traces
from .train import train_predictor


def _traces(engine, docs: Documents, folder: Path, max_tokens: int | None, label: str) -> TraceSet:
    manifest = folder / "manifest.json"
    if manifest.is_file():
        old = json.loads(manifest.read_text())
        if (
            old.get("model_identity") == engine.identity
            and old.get("data", {}).get("sha256") == docs.digest
            and old.get("max_tokens") == max_tokens
        ):
            return TraceSet(folder)
        shutil.rmtree(folder)
    record_traces(engine, docs, folder, max_tokens=max_tokens, label=label)
    data = json.loads(manifest.read_text())
    data["max_tokens"] = max_tokens
    manifest.write_text(json.dumps(data, indent=1))
    return TraceSet(folder)


def _model_ms_per_token(engine, tokens: int = 32) -> float:
    """Decode time per token of the engine itself, for the predictor's relative cost."""
    prompt = "def main():\n    "
    engine.generate(prompt, max_tokens=4)
    start = time.perf_counter()
    n = sum(1 for _ in engine.stream_generate(prompt, max_tokens=tokens))
    return (time.perf_counter() - start) / max(n, 1) * 1000


def _expert_bytes(engine) -> int:
    return sum(c.layout.expert_nbytes * c.num_experts for c in engine.caches)


def _predictor_section(predictor, engine, history: dict | None) -> dict:
    c = predictor.config
    params = predictor.num_params()
    nbytes = predictor.nbytes()
    latency = predictor_latency_ms(predictor, c.hidden_size, c.num_experts)
    model_ms = _model_ms_per_token(engine)
    expert_bytes = _expert_bytes(engine)
    section = {
        "params": params,
        "bytes": nbytes,
        "expert_bytes": expert_bytes,
        "size_fraction": nbytes / expert_bytes,
        "rank": c.rank,
        "depth": c.depth,
        "lookahead": c.lookahead,
        "macs_per_token": predictor.macs_per_token(),
        "latency_ms_per_token": latency,
        "model_ms_per_token": model_ms,
        "latency_fraction": latency / model_ms,
    }
    if history:
        section.update(
            {
                "training_s": history["seconds"],
                "epochs": len(history["train_loss"]),
                "steps": history["steps"],
                "train_loss": history["train_loss"],
                "heldout_loss": history["heldout_loss"],
                "trained_tokens": c.trained_tokens,
                **{f"next_use_{k}": v for k, v in history.get("next_use", {}).items()},
            }
        )
    return section


def _distances(predictor, traces: dict, engine):
    """The predictor's next-use estimates on `traces` (None for a predictor without the head)."""
    if not predictor.config.next_use:
        return None
    return trace_distances(predictor.next_use, traces, engine.num_experts)


# Held-out tokens below which the report's figures are too uncertain to compare: a recall over n tokens
# is known to about 0.5 / sqrt(n) (one standard error, tokens taken as independent), 0.016 at 1,000.
MEANINGFUL_TOKENS = 1000


def few_tokens_warning(tokens: int) -> str | None:
    """A sentence for a report on too few held-out tokens to mean much (None where there are enough)."""
    if tokens >= MEANINGFUL_TOKENS:
        return None
    margin = 0.5 / max(tokens, 1) ** 0.5
    return (
        f"only {tokens:,} held-out tokens: every figure below is uncertain by about +-{margin:.2f}, too much "
        f"to compare predictors or baselines; hold out {MEANINGFUL_TOKENS:,} or more (more data, or a higher "
        "--eval-tokens, eval-predictor's --max-tokens)"
    )


def _report(engine, predictor, heldout: TraceSet, routers, history=None) -> dict:
    traces = heldout.load()
    k = engine.top_k
    return {
        "warning": few_tokens_warning(int(len(traces["tokens"]))),
        "model": str(engine.model_path),
        "model_identity": engine.identity,
        "k": k,
        "tokens": int(len(traces["tokens"])),
        "data": heldout.manifest["data"],
        "lookahead": evaluate_predictor(predictor, traces, routers),
        "baselines": baselines(traces, routers, predictor.config.lookahead),
        "eviction": eviction_replay(traces, engine.num_experts, _distances(predictor, traces, engine)),
        "predictor": _predictor_section(predictor, engine, history),
    }


def _train_and_heldout(data, eval_data, text_field: str) -> tuple[Documents, Documents]:
    """The documents to train on and those to report on: `eval_data`, else 10% of `data` held out."""
    docs = load_documents(data, text_field)
    if eval_data is not None:
        return docs, load_documents(eval_data, text_field)
    train_docs, held_docs = split_documents(docs)
    if not held_docs.texts:
        raise UserError(
            f"{docs.source} has a single document, so none can be held out: give more documents or "
            "--eval-data"
        )
    return train_docs, held_docs


def train_predictor_job(
    model=None,
    data=None,
    text_field="text",
    eval_data=None,
    out="od-moe-predictor",
    lookahead=4,
    rank=80,
    depth=1,
    max_tokens=None,
    eval_tokens=16384,
    epochs=3,
    batch_size=512,
    lr=2e-3,
    capacity=None,
    memory_budget=None,
    traces_dir=None,
    keep_traces=False,
) -> dict:
    """Record, train, evaluate and save; returns the report (also written to `out/report.json`)."""
    from .. import load

    engine = load(model, capacity=capacity, memory_budget=memory_budget)
    L = len(engine.caches)
    if not isinstance(lookahead, int) or not 1 <= lookahead < L:
        raise UserError(
            f"lookahead {lookahead} must be 1 to {L - 1}: the model has {L} MoE layers, and a prediction "
            "must land on a layer that exists"
        )
    train_docs, held_docs = _train_and_heldout(data, eval_data, text_field)
    out = Path(out).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    traces_root = Path(traces_dir).expanduser() if traces_dir else out / "traces"
    heldout = _traces(engine, held_docs, traces_root / "heldout", eval_tokens, "recording held-out")
    train = _traces(engine, train_docs, traces_root / "train", max_tokens, "recording train")
    routers = engine.routers()
    config = PredictorConfig(
        engine.identity,
        L,
        engine.num_experts,
        train.manifest["hidden_size"],
        engine.top_k,
        lookahead=lookahead,
        rank=rank,
        depth=depth,
        data_sha256=train_docs.digest,
        trained_tokens=train.tokens,
        next_use=True,
    )
    predictor = ShadowPredictor(config)
    predictor.attach_routers(*routers)
    history = train_predictor(
        predictor,
        train,
        routers,
        epochs=epochs,
        batch_size=batch_size,
        lr=lr,
        heldout=heldout.load(max_tokens=4096),
    )
    history["next_use"] = fit_next_use(predictor.next_use, train, epochs=epochs)  # one flag, both parts
    predictor.set_dtype(
        mx.float16
    )  # stored and run in float16 (inputs stay float32): what is reported is what ships
    report = _report(engine, predictor, heldout, routers, history)
    report["train_data"] = train.manifest["data"]
    report["train_tokens"] = train.tokens
    predictor.record_metrics(
        {
            d: {"recall_at_k": v["recall_at_k"], "recall_at_2k": v["recall_at_2k"]}
            for d, v in report["lookahead"].items()
        }
    )
    predictor.save(out)
    (out / "report.json").write_text(json.dumps(report, indent=1))
    if not keep_traces and traces_dir is None:
        shutil.rmtree(traces_root, ignore_errors=True)
    return report


def eval_predictor_job(
    predictor_dir, data, model=None, text_field="text", max_tokens=16384, capacity=None, memory_budget=None
) -> dict:
    """Evaluate a saved predictor (and the baselines) on the text of `data`."""
    from .. import load

    engine = load(model, capacity=capacity, memory_budget=memory_budget)
    predictor = load_predictor(predictor_dir, engine.identity)
    routers = engine.routers()
    predictor.attach_routers(*routers)
    docs = load_documents(data, text_field)
    with tempfile.TemporaryDirectory(prefix="od-moe-traces-") as tmp:
        heldout = _traces(engine, docs, Path(tmp) / "eval", max_tokens, "recording")
        report = _report(engine, predictor, heldout, routers)
    report["predictor_path"] = str(predictor_dir)
    return report
