"""The llama.cpp backend on a Vulkan GPU: library.py (loading a Vulkan build of llama.cpp beside
llama-cpp-python's CPU build) and runtime.py (the llama.cpp Runtime opened through it)."""
