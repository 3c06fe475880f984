"""Reconfigurable process groups (gloo, NCCL, in a subprocess, wrapped, dummy).

Imports :mod:`dist_collectives.ft.coordination` (store clients) and nothing of
:mod:`dist_collectives.ft.replica`.
"""
