"""The time-to-first-token bench (`python -m od_moe.bench.serving ttft ...`) with its 8 prompts given as JSON
in argv[1]: the device has no `datasets`, through which `batch_prompts` reads the bundled text."""

import json
import sys

import od_moe.bench.first_token as f

P = json.loads(sys.argv[1])
f.batch_prompts = lambda n: P[:n]  # the bundled text's first 8 function lines
from od_moe.bench import serving  # noqa: E402  (after the prompts are in place)

sys.exit(serving.main(sys.argv[2:]))
