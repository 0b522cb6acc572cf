"""`od-moe bench`: arguments and the entry point. The default is the prefetch grid (`prefetch.py`: every
policy side by side); `--foundation` runs the cache-only benchmark against stock mlx-lm (`foundation.py`);
`--batch` many requests decoded together against stock mlx-lm's batches (`batch_speed.py`); `--two-tier` the
two-tier mode against stock mlx-lm and its roofline (`two_tier_grid.py`), which `--gpu` runs after the
prefetch grid. `--shape` builds a checkpoint of a real model's shapes (`real_shapes.py`) and says where it
is; with `--two-tier` the two-tier grid runs on it alone."""

import argparse
import json
import sys
from pathlib import Path

from ..errors import UserError
from ..memory.capacity import parse_capacity
from ..storage.model_files import DEFAULT_MODEL
from .real_shapes import NAMES as SHAPE_NAMES
from .widen import DEFAULT_WORKDIR


def add_arguments(parser):
    """`od-moe bench`'s flags: which grid runs and how (here), on which models (`_model_arguments`)."""
    add = parser.add_argument
    add(
        "--full",
        action="store_true",
        help="the whole grid: both models x 12.5/25/50%% x cold/warm x load/skip",
    )
    add(
        "--gpu",
        action="store_true",
        help="the accelerator grid: both models x 100/50/25%% x warm/cold x none/predictor/oracle on the "
        "per-layer path, then the two-tier grid",
    )
    add("--json", action="store_true", help="print the rows as JSON instead of tables")
    add("--max-tokens", type=int, default=64, help="new tokens per prompt on the bundled model")
    add(
        "--deterministic",
        action="store_true",
        help="prefetch reads land before they are needed and no timed check pauses prefetch: hit counts, "
        "bytes and tokens repeat exactly (for comparing code, not speed)",
    )
    add(
        "--plot",
        metavar="PATH",
        help="draw hit rate, tok/s and bytes read per token against capacity for each policy into PATH "
        "(.png or .svg; needs matplotlib: pip install 'od-moe[bench]'); the rows go beside it as .json "
        "(default: no plot)",
    )
    add("--foundation", action="store_true", help="the cache-only benchmark (capacities x LRU/LFU)")
    add(
        "--batch",
        action="store_true",
        help="batched decoding: --batch-sizes requests at once against stock mlx-lm's batch_generate",
    )
    add("--batch-sizes", default="1,2,8,32", help="with --batch: requests decoded together")
    add(
        "--two-tier",
        action="store_true",
        help="the two-tier grid alone: experts read in place from host memory, 0/25/50/100%% in device "
        "slots, against stock mlx-lm, Belady's MIN and the roofline",
    )
    add(
        "--rounds",
        type=int,
        help="with --batch or --two-tier: rounds alternating with stock (the median counts; default 3 with "
        "--batch, 6 with --two-tier and --gpu)",
    )
    add(
        "--capacities",
        help="with --foundation, --batch or --two-tier: fractions of experts resident (default: "
        "1,0.5,0.25,0.125 with --foundation, 0.5,0.25 with --batch, 0,0.25,0.5,1 with --two-tier)",
    )
    _model_arguments(add)


def _model_arguments(add):
    """The models a grid runs on: the bundled model, its widened copy (packed or not), a real shape."""
    add(
        "--widen",
        type=int,
        help="widening of the I/O-bound copy of the bundled model (0: none; default: 128, with --batch 0)",
    )
    add("--widened-tokens", type=int, default=32, help="new tokens per prompt on the widened model")
    add(
        "--workdir",
        default=str(DEFAULT_WORKDIR),
        help="where the widened model (about 1.4 GB at --widen 128) and --shape checkpoints are written",
    )
    add(
        "--predictor",
        help="a predictor trained on the bundled model for the predictor rows (default: bundled)",
    )
    add(
        "--pack",
        action="store_true",
        help="pack the widened model's experts first (`od-moe pack`) if they are not; a widened model "
        "packed before is read packed either way (the grid says which)",
    )
    add(
        "--packed",
        metavar="FILE",
        help="the widened model's packed experts, written elsewhere by `od-moe pack WIDENED --out FILE`: "
        "linked into the widened copy's folder, where every run reads them (default: none)",
    )
    add(
        "--shape",
        metavar="NAME",
        help="build a checkpoint of a real model's shapes into --workdir and say where it is (--two-tier: "
        "run the grid on it; default: none): " + ", ".join(SHAPE_NAMES),
    )
    add(
        "--shape-layers",
        type=int,
        metavar="N",
        help="with --shape: its first N layers only (small disks; default: all)",
    )


def run(args):
    from .foundation import run_foundation

    if args.shape or args.shape_layers is not None:
        return _shape(args)

    if args.widen is None:  # its default depends on --batch
        args = argparse.Namespace(**dict(vars(args), widen=0 if args.batch else 128))
    capacities = _capacities(args)
    rounds = args.rounds if args.rounds is not None else 3 if args.batch else 6
    if rounds < 1:
        raise UserError(f"--rounds must be a positive count, got {args.rounds}")
    if args.max_tokens < 1 or args.widened_tokens < 1 or args.widen < 0:
        raise UserError("--max-tokens and --widened-tokens must be positive, --widen >= 0")
    printer = None if args.json else print
    if args.plot:  # a missing matplotlib or a wrong name is found before the long run, not after
        from .plots import check_path, require_matplotlib

        if args.foundation:
            raise UserError("--plot draws the prefetch grid: leave out --foundation")
        check_path(args.plot)
        require_matplotlib()
    if (args.pack or args.packed) and (args.foundation or not args.widen):
        flag = "--pack packs" if args.pack else "--packed is"
        raise UserError(f"{flag} the prefetch grid's widened model: leave out --foundation, --widen 0")
    if args.pack and args.packed:
        raise UserError("choose one of --pack (pack the widened model now) and --packed FILE (packed before)")
    for alone in ("batch", "two_tier"):
        if getattr(args, alone) and (args.foundation or args.full or args.gpu or args.plot or args.pack):
            flag = "--" + alone.replace("_", "-")
            raise UserError(f"{flag} runs alone: leave out --foundation, --full, --gpu, --plot and --pack")
    if args.batch:
        from .batch_speed import run_batch_grid

        result = run_batch_grid(
            _batch_sizes(args), capacities, args.max_tokens, args.widen, Path(args.workdir), printer, rounds
        )
    elif args.two_tier:
        result = _two_tier(args, capacities, rounds, printer)
    elif args.foundation:
        result = run_foundation(
            capacities, args.max_tokens, args.widen, args.widened_tokens, Path(args.workdir), printer
        )
    else:
        from .prefetch import run_prefetch_grid

        if args.full and args.gpu:
            raise UserError("choose one of --full and --gpu")
        result = run_prefetch_grid(
            "full" if args.full else "gpu" if args.gpu else "quick",
            args.max_tokens,
            args.widen,
            args.widened_tokens,
            Path(args.workdir),
            printer,
            predictor_dir=args.predictor,
            deterministic=args.deterministic,
            pack=args.packed or args.pack,
        )
    if args.gpu:
        result["rows"] += _two_tier(args, [float(f) for f in (0, 0.25, 0.5, 1)], rounds, printer)["rows"]
    if args.plot:
        from .plots import plot_rows

        plot_rows(
            result["rows"],
            args.plot,
            title=f"od-moe bench ({'gpu' if args.gpu else 'full' if args.full else 'quick'} grid)",
        )
        where = Path(args.plot)
        print(f"plot written to {where} (rows in {where.with_suffix('.json')})", file=sys.stderr)
    if args.json:
        print(json.dumps(result, indent=1))


def _shape(args):
    """`--shape`: build (or find) the named checkpoint, say where it is, run the two-tier grid on it if
    asked."""
    from ..units import format_bytes
    from .real_shapes import build_shape, default_dest, describe

    if not args.shape:
        raise UserError("--shape-layers counts the layers of --shape NAME: name the shape too")
    others = ("foundation", "batch", "full", "gpu", "plot", "pack")
    if any(getattr(args, flag) for flag in others):
        raise UserError(
            "--shape runs alone or with --two-tier: leave out --foundation, --batch, --full, "
            "--gpu, --plot and --pack"
        )
    rounds = args.rounds if args.rounds is not None else 6
    if rounds < 1 or args.max_tokens < 1:
        raise UserError("--rounds and --max-tokens must be positive counts")
    facts = describe(args.shape, args.shape_layers)  # a wrong name or layer count fails before any work
    path = build_shape(
        args.shape, default_dest(args.workdir, args.shape, args.shape_layers), args.shape_layers
    )
    result = {"shape": args.shape, "path": str(path), **facts}
    if not args.json:
        print(
            f"{args.shape}: {path} ({format_bytes(facts['bytes'])}, {facts['layers']} layers, "
            f"{facts['experts']} experts of {format_bytes(facts['expert_bytes'])}, top-{facts['top_k']})"
        )
    if args.two_tier:
        from .two_tier_grid import run_two_tier_grid

        printer = None if args.json else print
        result["rows"] = run_two_tier_grid(
            [(args.shape, path, args.max_tokens)], _capacities(args), rounds, printer
        )["rows"]
    if args.json:
        print(json.dumps(result, indent=1))


def _capacities(args) -> list[float]:
    """`--capacities` as fractions (0 allowed with --two-tier: every expert read in place)."""
    default = "0.5,0.25" if args.batch else "0,0.25,0.5,1" if args.two_tier else "1,0.5,0.25,0.125"
    capacities = []
    for text in str(args.capacities or default).split(","):
        value = 0.0 if args.two_tier and text.strip() in ("0", "0%") else parse_capacity(text)
        value = 1.0 if value == 1 else value
        if not isinstance(value, float) or not 0 <= value <= 1 or (value == 0 and not args.two_tier):
            raise UserError(f"--capacities takes fractions in (0, 1] (with --two-tier [0, 1]), got {text!r}")
        capacities.append(value)
    return capacities


def _batch_sizes(args) -> list[int]:
    try:
        sizes = [int(s) for s in args.batch_sizes.split(",")]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        raise UserError(f"--batch-sizes takes positive counts such as 1,2,8,32, got {args.batch_sizes!r}")
    return sizes


def _two_tier(args, fractions, rounds: int, printer) -> dict:
    from .prefetch import widened_copy
    from .two_tier_grid import run_two_tier_grid

    models = [("bundled", DEFAULT_MODEL, args.max_tokens)]
    if args.widen:
        models.append(
            (
                "widened",
                widened_copy(args.widen, Path(args.workdir), False, printer or (lambda *_: None)),
                args.widened_tokens,
            )
        )
    return run_two_tier_grid(models, fractions, rounds, printer)
