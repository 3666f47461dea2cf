"""Contracts every stage shares: the one strict config, Arrow schemas, crash-safe parts, typed errors, the run store.

Nothing here imports a stage package, so every stage can import it without cycles.
"""
