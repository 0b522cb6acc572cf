"""The predictor report as tables for people (`od-moe train-predictor`, `od-moe eval-predictor`)."""

from ..accounting.report import table


def format_report(report: dict) -> str:
    k = report["k"]
    base = report["baselines"]
    rows = []
    for d, v in report["lookahead"].items():
        rows.append(
            [
                d,
                v["recall_at_k"],
                v["recall_at_2k"],
                base["next_gate"].get(d),
                base.get("next_gate_recall_at_2k", {}).get(d),
            ]
        )
    parts = [f"warning: {report['warning']}"] if report.get("warning") else []
    parts += [
        table(
            [
                "lookahead",
                f"predictor recall@{k}",
                f"predictor recall@{2 * k}",
                f"next-gate recall@{k}",
                f"next-gate recall@{2 * k}",
            ],
            rows,
            title=f"Held-out tokens: {report['tokens']:,} ({report['data']['source']})",
        )
    ]
    n_layers = max(len(v["per_layer"]) for v in report["lookahead"].values())
    per = [
        [d] + v["per_layer"] + [None] * (n_layers - len(v["per_layer"]))
        for d, v in report["lookahead"].items()
    ]
    parts.append(
        table(
            ["lookahead"] + [f"from L{i}" for i in range(n_layers)],
            per,
            title=f"Predictor recall@{k} per source layer i (predicting layer i+d)",
        )
    )
    prof = base["static_profile"]
    parts.append(
        table(
            ["baseline", "figure"],
            [
                [f"previous token's experts, recall@{k}", base["prev_token"]],
                *[
                    [f"static frequency profile at {float(f):.1%} resident, hit rate", v]
                    for f, v in prof.items()
                ],
            ],
        )
    )
    p = report["predictor"]
    rows = [
        ["parameters", p["params"]],
        ["size / expert bytes (both on disk)", p["size_fraction"]],
        ["multiply-adds per token (all source layers)", p["macs_per_token"]],
        ["latency ms per token (all source layers)", p["latency_ms_per_token"]],
        ["model decode ms per token (same run)", p["model_ms_per_token"]],
        ["latency / model decode", p["latency_fraction"]],
    ]
    if "training_s" in p:
        rows += [
            ["trained tokens", p["trained_tokens"]],
            ["epochs", p["epochs"]],
            ["training s", p["training_s"]],
            ["train loss per epoch", " ".join(f"{x:.3f}" for x in p["train_loss"])],
            ["held-out loss per epoch", " ".join(f"{x:.3f}" for x in p["heldout_loss"])],
        ]
    if "next_use_training_s" in p:
        rows += [
            ["next-use head training s", p["next_use_training_s"]],
            ["next-use head loss per epoch", " ".join(f"{x:.3f}" for x in p["next_use_train_loss"])],
        ]
    parts.append(table(["predictor", "value"], rows))
    if "eviction" in report:
        parts.append(_eviction_table(report["eviction"]))
    return "\n\n".join(parts)


def _eviction_table(eviction: dict) -> str:
    fractions = list(eviction)
    rules = list(eviction[fractions[0]])
    rows = [
        [rule]
        + [
            f"{eviction[f][rule]['reads_per_token']:.1f} ({eviction[f][rule]['hit_rate']:.3f})"
            for f in fractions
        ]
        for rule in rules
    ]
    return table(
        ["eviction rule"] + [f"{float(f):.1%} resident" for f in fractions],
        rows,
        title="Demand reads on the held-out routing: experts read per token, all layers (hit rate); "
        "next-use: the predictor's estimate of each expert's next use; min@n knows the next n tokens",
    )
