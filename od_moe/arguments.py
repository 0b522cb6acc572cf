"""The `od-moe` command's arguments: one parser, a sub-parser per command, every default shown in `--help`.
Not here: what the commands do (`cli.py`).
"""

import argparse


def _capacity_arg(parser: argparse.ArgumentParser):
    # not exclusive: on a GPU with memory of its own the memory budget is the host's and goes with a capacity
    parser.add_argument(
        "--capacity",
        help="experts resident per MoE layer: a count (16), a fraction (0.25) or 25%% (default: what the "
        "memory budget holds, or on CUDA the device budget)",
    )
    parser.add_argument(
        "--memory-budget",
        help="memory for the whole engine, e.g. 8GB or 512MiB, or on CUDA the host's (every expert in "
        "two-tier mode); not with --capacity except on CUDA (default: 70%% of available)",
    )


def _direct_io_arg(parser: argparse.ArgumentParser):
    parser.add_argument(
        "--direct-io",
        choices=["auto", "on", "off"],
        default="auto",
        help="read experts past the OS page cache (default auto: when the model is larger than memory)",
    )


def _two_tier_arg(parser: argparse.ArgumentParser):
    parser.add_argument(
        "--two-tier",
        choices=["auto", "on", "off", "lru"],
        default="auto",
        help="every expert in host memory, read in place on a miss, --capacity experts per layer in device "
        "slots (default auto: on CUDA where host memory holds the experts, as lru for experts of 1 MB or "
        "more; lru: on, its slots kept on the device, least recently used, each miss copied in)",
    )


def _packed_arg(parser: argparse.ArgumentParser, whose: str = "the model's"):
    parser.add_argument(
        "--packed",
        metavar="FILE",
        help=f"read {whose} experts from this packed file (`od-moe pack --out FILE`; default: "
        "MODEL/od-moe-packed/experts.safetensors where it exists, else the checkpoint's arrays)",
    )


def _device_args(parser: argparse.ArgumentParser):
    parser.add_argument(
        "--device-memory",
        metavar="SIZE",
        help="on a GPU with memory of its own (CUDA), what od-moe may use of it, e.g. 12GB (default: 90%% of "
        "what the card has free); --memory-budget is then the host's",
    )
    parser.add_argument(
        "--context-tokens",
        type=int,
        metavar="N",
        help="tokens of KV cache the device budget keeps room for, per sequence (default: 4352, a 4k-token "
        "prompt and 256 generated, at most the model's positions)",
    )


def _placement_args(parser: argparse.ArgumentParser):
    """Where experts live while generating: how many per layer, on a device of its own, read past the page
    cache, two tiers, packed rows."""
    _capacity_arg(parser)
    _device_args(parser)
    _direct_io_arg(parser)
    _two_tier_arg(parser)
    _packed_arg(parser)


def _draft_args(parser: argparse.ArgumentParser, serving: str = ""):
    """mlx-lm's speculative decoding flags, with its names and default (`od_moe/generation/drafts.py`)."""
    parser.add_argument(
        "--draft-model",
        metavar="MODEL",
        help="a model folder or hub id that drafts tokens for the model to verify (speculative decoding, as "
        f"mlx-lm's; loaded whole, resident; its tokenizer must be the model's{serving}; 'bundled': the "
        "embedded model's draft; default: none)",
    )
    parser.add_argument(
        "--num-draft-tokens",
        type=int,
        default=3,
        help="tokens to draft a pass when using --draft-model or --prompt-lookup",
    )
    parser.add_argument(
        "--prompt-lookup",
        action="store_true",
        help="draft from the text so far instead of a draft model: the tokens after the latest earlier "
        "occurrence of the last 3 tokens, only where there is one "
        "(`od_moe/generation/prompt_lookup.py`; pays where the answer repeats the prompt, as code edits do; "
        "default: off)",
    )


class _DefaultsFormatter(argparse.HelpFormatter):
    """Help that shows every flag's default: written into its help where that says more, else appended."""

    def _get_help_string(self, action):
        text = action.help or ""
        unset = action.default is None or action.default is False or action.default == argparse.SUPPRESS
        if "default" in text or unset or not action.option_strings:
            return text
        return f"{text} (default: %(default)s)" if text else "default: %(default)s"


def build_parser() -> "_OneLineErrors":
    """The parser of the `od-moe` command and its sub-commands."""
    parser = _OneLineErrors(prog="od-moe", description="Run Mixture-of-Experts models larger than memory.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_commands(dest="command", required=True, metavar="COMMAND", parser_class=_SubParser)
    _add_generate(sub)
    _add_serve(sub)
    _add_bench(sub)
    _add_train_predictor(sub)
    _add_eval_predictor(sub)
    _add_pack(sub)
    _add_inspect(sub)
    return parser


def _add_generate(sub):
    gen = sub.add_parser("generate", help="stream a completion of a prompt")
    gen.add_argument("--model", help="model folder or hub id (default: the embedded tiny Qwen3-MoE)")
    gen.add_argument(
        "--prompt",
        required=True,
        help="text to continue, or '-' to read it from standard input (as mlx-lm's generate)",
    )
    gen.add_argument(
        "--system-prompt",
        help="a system message before the prompt (with the chat template only; default: none)",
    )
    gen.add_argument(
        "--ignore-chat-template",
        action="store_true",
        help="continue the raw prompt (by default, as mlx-lm's generate does, the prompt goes into the "
        "tokenizer's chat template as a user message when the tokenizer has one)",
    )
    gen.add_argument(
        "--chat-template-config",
        metavar="JSON",
        help="further arguments for the chat template, a JSON object (e.g. '{\"enable_thinking\": false}'; "
        "default: none)",
    )
    gen.add_argument("--max-tokens", type=int, default=256, help="the most tokens to generate")
    _placement_args(gen)
    gen.add_argument(
        "--miss-policy",
        choices=["load", "skip"],
        default="load",
        help="load: exact, read missing experts before use; skip: approximate, drop them",
    )
    gen.add_argument(
        "--eviction",
        choices=["lru", "lfu"],
        default="lru",
        help="which resident expert a read replaces: least recently or least frequently used",
    )
    gen.add_argument(
        "--predictor",
        help="a shadow predictor folder (train-predictor's --out); 'bundled' for the embedded model's "
        "(default: none, no predictor). Past the host's memory on CUDA (three tiers) it orders the host "
        "tier's eviction where its report finds its next-use head reading less than recency",
    )
    gen.add_argument(
        "--prefetch",
        choices=["none", "profile", "next-gate", "predictor", "oracle"],
        help="what drives prefetching (default: predictor with --predictor, else none); oracle "
        "first generates once to record the true routing, then replays it (an upper bound)",
    )
    gen.add_argument(
        "--temp",
        type=float,
        default=0.0,
        help="sampling temperature, 0 to 2 as OpenAI's API takes it (0: greedy)",
    )
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: keep this much probability")
    gen.add_argument(
        "--seed", type=int, help="random seed for sampling, 0 to 2**63 - 1 (default: none, a fresh one)"
    )
    gen.add_argument(
        "--snapshot",
        help="warm-start from a snapshot folder saved for this model and capacity (default: none, an empty "
        "cache)",
    )
    gen.add_argument(
        "--save-snapshot", help="after generating, save the resident set to this folder (default: not saved)"
    )
    _draft_args(gen)
    gen.add_argument("--stats", action="store_true", help="print cache statistics after the text")


def _add_serve(sub):
    srv = sub.add_parser("serve", help="serve OpenAI-compatible completions and chat over HTTP, with /health")
    srv.add_argument("--model", help="model folder or hub id (default: the embedded tiny Qwen3-MoE)")
    srv.add_argument(
        "--predictor",
        help="a shadow predictor folder written by train-predictor ('bundled': the embedded model's; "
        "default: none, no predictor)",
    )
    srv.add_argument(
        "--prefetch",
        choices=["none", "profile", "next-gate", "predictor"],
        help="what drives prefetching (default: predictor with --predictor, else none)",
    )
    srv.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to bind (default loopback; anything else is your choice to expose it)",
    )
    srv.add_argument("--port", type=int, default=8080, help="port to listen on (0: any free one)")
    _placement_args(srv)
    srv.add_argument(
        "--max-tokens",
        type=int,
        help="the most tokens one request may ask for (default: the model's maximum positions; every "
        "generation stops where prompt and completion fill them)",
    )
    srv.add_argument(
        "--max-input-tokens",
        type=int,
        help="the longest prompt accepted, in tokens (default: one less than the model's maximum positions)",
    )
    srv.add_argument(
        "--max-batch",
        type=int,
        default=8,
        help="requests decoded together, joining and leaving between decode steps (1: one at a time, "
        "reusing the previous request's KV cache for a shared prompt prefix)",
    )
    _draft_args(srv, "; every request drafts, one at a time: batching is off, as in mlx-lm's server")
    srv.add_argument(
        "--schedule-log",
        metavar="PATH",
        help="write the running batch's schedule to PATH as it runs (one JSON event a line: joins with their "
        "prompt tokens, leaves, the tokens given), to replay it through stock mlx-lm with `python3 -m "
        "od_moe.server.schedule PATH` (needs --max-batch 2 or more; default: not written)",
    )
    srv.add_argument(
        "--allow-host",
        action="append",
        default=[],
        metavar="NAME",
        help="a further name the Host header may carry (repeatable; default: the --host address, and the "
        "loopback names when bound to loopback)",
    )
    srv.add_argument(
        "--allow-origin",
        action="append",
        default=[],
        metavar="ORIGIN",
        help="a web origin (https://example.org, or *) whose pages may call the server (repeatable; "
        "default: none, browser requests from other origins are refused)",
    )


def _add_bench(sub):
    bench = sub.add_parser("bench", help="measure speed, memory, hit rate and reads against stock mlx-lm")
    from .bench.cli import add_arguments

    add_arguments(bench)


def _add_train_predictor(sub):
    train = sub.add_parser(
        "train-predictor", help="record routing traces, train the shadow predictor, report its accuracy"
    )
    train.add_argument("--model", help="model folder or hub id (default: the embedded tiny Qwen3-MoE)")
    train.add_argument(
        "--data",
        help=(
            "text/JSON lines/parquet file, a folder of them, or a hub dataset (default: bundled Python "
            "source)"
        ),
    )
    train.add_argument(
        "--text-field", default="text", help="the column holding the text in JSON/parquet/CSV data"
    )
    train.add_argument(
        "--eval-data", help="held-out text to report on (default: 10%% of --data's documents, held out)"
    )
    train.add_argument(
        "--out",
        default="od-moe-predictor",
        help="folder for the predictor and report.json (default: ./od-moe-predictor)",
    )
    train.add_argument(
        "--lookahead", type=int, default=4, help="predict the experts of this many layers ahead"
    )
    train.add_argument(
        "--max-tokens", type=int, default=200_000, help="training tokens to record (default 200000)"
    )
    train.add_argument(
        "--eval-tokens", type=int, default=16384, help="held-out tokens to record (default 16384)"
    )
    train.add_argument(
        "--epochs",
        type=int,
        default=3,
        help="passes over the training traces, for the shadow network and its next-use head alike",
    )
    train.add_argument(
        "--rank",
        type=int,
        default=80,
        help="width of the predictor trunk (default 80: under 5%% of the expert bytes here)",
    )
    train.add_argument(
        "--depth",
        type=int,
        default=1,
        help="trunk layers (default 1; more add residual layers of width --rank)",
    )
    train.add_argument(
        "--batch-size", type=int, default=512, help="training examples (token, layer) per optimiser step"
    )
    train.add_argument("--lr", type=float, default=2e-3, help="the optimiser's (Adam's) learning rate")
    train.add_argument(
        "--traces", help="folder to record traces into and reuse (default: OUT/traces, removed after)"
    )
    train.add_argument("--keep-traces", action="store_true", help="keep OUT/traces after training")
    train.add_argument("--json", action="store_true", help="print report.json instead of the tables")
    _capacity_arg(train)


def _add_eval_predictor(sub):
    ev = sub.add_parser("eval-predictor", help="report a predictor's accuracy and the baselines on any text")
    ev.add_argument("--model", help="model folder or hub id (default: the embedded tiny Qwen3-MoE)")
    ev.add_argument(
        "--predictor",
        required=True,
        help="folder written by train-predictor ('bundled': the embedded model's)",
    )
    ev.add_argument(
        "--data", required=True, help="text/JSON lines/parquet file, a folder of them, or a hub dataset"
    )
    ev.add_argument(
        "--text-field", default="text", help="the column holding the text in JSON/parquet/CSV data"
    )
    ev.add_argument(
        "--max-tokens", type=int, default=16384, help="tokens to record and evaluate (default 16384)"
    )
    ev.add_argument("--json", action="store_true", help="print the report as JSON")
    _capacity_arg(ev)


def _add_pack(sub):
    pk = sub.add_parser(
        "pack", help="write a copy of the experts with each expert contiguous: one read per expert"
    )
    pk.add_argument("model", nargs="?", help="model folder (default: the embedded tiny Qwen3-MoE)")
    pk.add_argument(
        "--out",
        help="the packed file to write (default: MODEL/od-moe-packed/experts.safetensors, which every "
        "command finds; elsewhere, pass it as --packed FILE, or load(packed=FILE) in Python; required "
        "without MODEL: the embedded model is not written into)",
    )


def _add_inspect(sub):
    ins = sub.add_parser("inspect", help="what loading a model would do, without loading its weights")
    ins.add_argument("model", nargs="?", help="model folder or hub id (default: the embedded tiny Qwen3-MoE)")
    ins.add_argument(
        "--memory-budget", help="the budget whose capacity to report (default: 70%% of available)"
    )
    ins.add_argument(
        "--capacity",
        help="experts per layer (16, 0.25 or 25%%) whose memory budget to report (default: what the memory "
        "budget holds)",
    )
    ins.add_argument("--predictor", help="a predictor folder to check (default: one beside the model)")
    ins.add_argument(
        "--ranks",
        type=int,
        default=1,
        help="processes to split the layers over: each rank's layers and memory",
    )
    _packed_arg(ins)
    _device_args(ins)
    ins.add_argument("--json", action="store_true", help="print the report as JSON")


class _OneLineErrors(argparse.ArgumentParser):
    """A parser whose mistakes are one line, `od-moe: error: ...`, naming the command's own help (argparse
    would print the top-level usage first, even for a sub-command's flag), and exit with code 2."""

    commands: dict[str, argparse.ArgumentParser]  # each command's own parser, by name (`add_commands`)

    def error(self, message):
        self.exit(2, f"od-moe: error: {message} (see '{self.prog} --help')\n")

    def add_commands(self, **kwargs):
        """`add_subparsers`, each command's own parser kept in `commands` by name as it is added (for the
        errors found after parsing)."""
        sub = self.add_subparsers(**kwargs)
        self.commands = sub.choices
        return sub


class _SubParser(_OneLineErrors):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, formatter_class=_DefaultsFormatter, **kwargs)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("od-moe")
    except PackageNotFoundError:
        return "unknown (not installed)"
