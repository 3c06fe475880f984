"""The Manager of one replica: its step, its quorum worker, its state transfer, DDP.

Sits on top: imports :mod:`dist_collectives.ft.coordination` and
:mod:`dist_collectives.ft.groups`.
"""
