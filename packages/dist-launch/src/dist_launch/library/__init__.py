"""The Python API: :func:`launch_subprocesses` and :func:`init_and_run`."""
