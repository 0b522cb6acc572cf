"""Benchmarks run by `od-moe bench`: od-moe against stock mlx-lm on the same model in one process."""
