"""The ``quorumfl`` admin CLI (Typer + Rich): thin commands over ``quorumfl.server.services``."""
