"""Prefect layer: thin @task/@flow wrappers over `tasks/`, one task run per shard (never per sample).

Importing it makes a closed stdout/stderr quiet instead of fatal (`broken_pipe`: a flow run outlives its worker) and
logs this package's typed errors in one line (`run_log`)."""

from flows import broken_pipe, run_log

broken_pipe.install()
run_log.install()
