"""Torch-side training beside the exporters: the draft head (draft_head.py, its data and training)
and distillation of a draft (distill.py)."""
