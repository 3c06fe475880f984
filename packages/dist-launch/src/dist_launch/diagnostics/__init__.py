"""Reports of what went wrong, built from outcomes and stacks: pure functions."""
