"""VMU: the host arena (shared memory) and each device's text / data / stack accounting."""
