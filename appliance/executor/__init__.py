"""Executors: the device seam (CPU / CUDA) and the op-graph interpreter."""
