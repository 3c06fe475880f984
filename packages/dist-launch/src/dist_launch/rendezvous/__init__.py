"""How the nodes of a job meet (static, c10d or etcd), and what the nodes of a round share."""
