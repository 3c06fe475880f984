"""Where output goes: the relay, ``--log-dir``'s layout, the log, the scratch directories."""
