"""Transparent capture: LazyTensor, the ``remote_accelerator`` device, factories, capture."""
