"""What od-moe does to an mlx-lm model: find its MoE blocks and swap their experts (`moe_blocks.py`), read its
routers (`routing.py`), run mlx-lm's switch over other arrays (`switch_over.py`), and the private mlx-lm names
it relies on (`mlx_lm_private.py`).

Not here: the modules swapped in (`per_layer/`, `two_tier/`), or loading the model's files (`storage/`).
"""
