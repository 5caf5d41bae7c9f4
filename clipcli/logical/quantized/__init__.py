"""Quantized weights as logical tensors: one module per scheme (scheme.py: the interface)."""
