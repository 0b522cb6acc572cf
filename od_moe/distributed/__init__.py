"""One model over the ranks of an `mx.distributed` group: its decoder layers split between them, each
rank offloading its own layers' experts as one process does.

- `rank_split.py`: the split itself (which rank runs which layers, the seams the hidden state crosses);
- `seams.py`: the rank before a seam predicts the next rank's first MoE layer, so its reads start early;
- `heartbeat.py`: the ranks' supervision outside `mx.distributed` (which has no timeouts), and the
  connection their other messages travel on;
- `local_ranks.py`: starting a script on several ranks of this machine (tests, lab scripts).

Not here: serving across ranks (`od_moe/server/ranks.py`), the expert cache, reads or prefetch (each
rank's engine runs them over its own layers: `od_moe/per_layer/`).
"""
