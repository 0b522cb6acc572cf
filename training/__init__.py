"""Routing traces and shadow-predictor training (installed as `od_moe.training`).

`data` turns text sources into documents split by document; `record` runs the model over them and stores
routing traces; `train` fits a shadow predictor on traces; `evaluate` measures it and the baselines.
"""
