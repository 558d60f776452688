"""Pure wire codec: frames, message kinds, tensor descriptors. No I/O lives here."""
