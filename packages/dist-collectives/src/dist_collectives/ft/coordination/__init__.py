"""The replica protocol's side of the store: addresses, bounded connections, quorums.

Imports nothing else of ``ft`` but :mod:`dist_collectives.ft.errors`.
"""
