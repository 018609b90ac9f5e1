"""The OpenVINO backend: runtime.py (the Runtime), kv.py (its KV holders), graph.py (the IR rewritten
before it is compiled), split.py (a draft head on the target's body), compile_cache.py (compiled blobs
kept across processes). Nothing here is imported until the backend is used."""
