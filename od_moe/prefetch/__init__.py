"""Prefetch: the policies that predict which experts a layer will need (`policies.py`), and the governor that
sizes prefetch and pauses it where it does not pay (`governor.py`), run as its settings say
(`PrefetchSettings`, frozen: given with the policy, `Runtime.set_policy`, never written afterwards). The
per-layer path runs their hooks and reads what they predict; two tiers run only their prompt hooks.

Not here: the reads themselves (`per_layer/reader.py`, `per_layer/loader.py`), or the shadow network
(`predictor/`).
"""
