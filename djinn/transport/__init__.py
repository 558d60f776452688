"""Sockets and shared memory: how frames and tensor bytes move between processes."""
