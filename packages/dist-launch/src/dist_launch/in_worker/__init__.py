"""What runs inside a worker: the bootstrap, the fork server, the progress beacon.

These modules import the standard library and dist-core only, so that a worker starts
light; the launcher refers to them by module path and by variable name.
"""
