"""Client runtime: connections, sessions and remote tensors."""
