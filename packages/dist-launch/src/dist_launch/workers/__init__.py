"""The launcher's side of its workers: their environment, their terminals, and how they start."""
