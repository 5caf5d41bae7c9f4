"""Logical tensors: what jobs select, measure, plan, clip, diff and report, over what a
reader stores (see view.py)."""
