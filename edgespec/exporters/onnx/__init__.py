"""The ONNX graph writers: graph.py (the decoder graph), blocks.py, fused.py, masks.py and tree.py
(its parts), quantize.py (weight-only quantization of the written graph)."""
