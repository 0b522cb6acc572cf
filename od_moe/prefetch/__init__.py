"""Prefetch: the policies that predict which experts a layer will need (`policies.py`), and the governor that
sizes prefetch and pauses it where it does not pay (`governor.py`).

Not here: the reads themselves (`per_layer/reader.py`), or the shadow network (`predictor/`).
"""
