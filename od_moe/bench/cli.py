"""`od-moe bench`: arguments and the entry point. The default is the prefetch grid (`prefetch.py`: every
policy side by side); `--foundation` runs the cache-only benchmark against stock mlx-lm (`foundation.py`)."""

import json
import tempfile
from pathlib import Path

from ..capacity import parse_capacity
from ..errors import UserError


def add_arguments(parser):
    parser.add_argument(
        "--capacities",
        default="1,0.5,0.25,0.125",
        help="with --foundation: comma-separated fractions of experts resident (default 1,0.5,0.25,0.125)",
    )
    parser.add_argument(
        "--max-tokens", type=int, default=64, help="new tokens per prompt on the bundled model"
    )
    parser.add_argument(
        "--widen",
        type=int,
        default=128,
        help="widening factor of the I/O-bound copy of the bundled model (0: skip it)",
    )
    parser.add_argument(
        "--widened-tokens", type=int, default=32, help="new tokens per prompt on the widened model"
    )
    parser.add_argument(
        "--workdir",
        default=str(Path(tempfile.gettempdir()) / "od-moe-bench"),
        help="where the widened model is written (about 1.4 GB at --widen 128)",
    )
    parser.add_argument(
        "--predictor",
        help="a predictor folder trained on the bundled model (train-predictor's --out) for "
        "the predictor rows, in place of the bundled one; the widened copy uses it too",
    )
    parser.add_argument("--json", action="store_true", help="print the rows as JSON instead of tables")
    parser.add_argument(
        "--full",
        action="store_true",
        help="the whole grid: both models x 12.5/25/50%% x cold/warm x load/skip x every policy",
    )
    parser.add_argument(
        "--foundation", action="store_true", help="the cache-only benchmark (capacities x LRU/LFU)"
    )
    parser.add_argument(
        "--deterministic",
        action="store_true",
        help="prefetch reads land before they are needed and no timed check pauses prefetch: "
        "hit counts, bytes and tokens repeat exactly (for comparing code, not speed)",
    )


def run(args):
    from .foundation import run_foundation

    capacities = []
    for text in str(args.capacities).split(","):
        value = parse_capacity(text)
        value = 1.0 if value == 1 else value
        if not isinstance(value, float) or not 0 < value <= 1:
            raise UserError(f"--capacities takes fractions in (0, 1], got {text!r}")
        capacities.append(value)
    if args.max_tokens < 1 or args.widened_tokens < 1 or args.widen < 0:
        raise UserError("--max-tokens and --widened-tokens must be positive, --widen >= 0")
    printer = None if args.json else print
    if args.foundation:
        result = run_foundation(
            capacities, args.max_tokens, args.widen, args.widened_tokens, Path(args.workdir), printer
        )
    else:
        from .prefetch import run_prefetch_grid

        result = run_prefetch_grid(
            args.full,
            args.max_tokens,
            args.widen,
            args.widened_tokens,
            Path(args.workdir),
            printer,
            predictor_dir=args.predictor,
            deterministic=args.deterministic,
        )
    if args.json:
        print(json.dumps(result, indent=1))
