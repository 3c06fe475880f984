"""How the nodes of a job meet (static or c10d), and what the nodes of a round share."""
