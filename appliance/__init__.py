"""The appliance: supervisor, executor workers, memory (VMU) and sessions."""
