"""Prefect layer: thin @task/@flow wrappers over `tasks/`, one task run per shard (never per sample)."""
