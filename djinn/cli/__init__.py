"""Command line (typer). Commands stay thin and import heavy modules inside themselves."""
