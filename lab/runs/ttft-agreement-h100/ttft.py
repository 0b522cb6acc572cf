import json, sys
import od_moe.bench.first_token as f
P = json.loads(sys.argv[1])
f.batch_prompts = lambda n: P[:n]  # the bundled text's first 8 function lines; the device has no `datasets`
from od_moe.bench import serving
sys.exit(serving.main(sys.argv[2:]))
