"""Prefect layer: thin @task/@flow wrappers over `tasks/`, one task run per shard (never per sample).

Importing it makes a closed stdout/stderr quiet instead of fatal (`broken_pipe`): a flow run outlives its worker."""

from flows import broken_pipe

broken_pipe.install()
