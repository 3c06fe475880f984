"""Where output goes: the prefixed line relay, ``--log-dir``'s layout, the launcher's log."""
