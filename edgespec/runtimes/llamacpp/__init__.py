"""The llama.cpp backend: runtime.py (the Runtime on llama-cpp-python's ctypes API, and
`load_library`, the one way into that API, which the GGUF exporter uses too)."""
