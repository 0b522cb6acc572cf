"""Generation around the engine: samplers (`sampling.py`), speculative decoding with a draft model
(`drafts.py`) or prompt lookup (`prompt_lookup.py`), and batched decoding (`batch_generate.py`).

Not here: the engine itself (`engine.py`), or the server's continuous batching (`server/batching.py`).
"""
