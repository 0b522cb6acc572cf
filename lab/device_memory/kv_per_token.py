"""Lab: KV cache a token takes for each real shape, as `capacity.kv_nbytes_per_token` measures it (a lazy
run into mlx-lm's caches) beside the older count of k and v projection outputs (not product code). The
models are built from the shapes' configs with no weights read or drawn (lazy arrays).

  python3 lab/device_memory/kv_per_token.py
"""

import mlx.core as mx

from od_moe.bench.real_shapes import SHAPES, shape_config
from od_moe.memory.capacity import _projected_kv_nbytes_per_token, kv_nbytes_per_token
from od_moe.model_surgery.mlx_lm_private import model_classes

for name in SHAPES:
    config = shape_config(name)
    model_class, args_class = model_classes(config)
    model = model_class(args_class.from_dict(config))
    model.set_dtype(mx.bfloat16)
    measured, projected = kv_nbytes_per_token(model), _projected_kv_nbytes_per_token(model)
    print(f"{name}: {measured:,} B a token (projections: {projected:,})")
