"""The onnxruntime backend: runtime.py (the Runtime), kv.py (its KV holders), wire.py and graphs.py
(the decoder graph read and rewritten at load), split.py (a draft head on the target's body), pool.py
(one thread pool for every session of the process). Nothing here is imported until the backend is used."""
