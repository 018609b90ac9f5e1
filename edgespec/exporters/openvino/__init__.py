"""The OpenVINO exporter: export.py converts an edgespec graph to IR and compresses its weights."""
