"""What watches a running round: the hang watch, its decision, torch elastic's timers."""
