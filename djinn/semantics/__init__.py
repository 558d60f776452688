"""Semantics: what a graph *means* (phase, modality, residency) and what it costs.

Patterns and cost models are plugins found through entry points (``djinn.patterns``,
``djinn.cost_models``); the built-ins in ``djinn.plugins`` register exactly as a third
party would. See docs/plugins.md.
"""
