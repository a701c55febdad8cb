"""``python -m quorumfl.server.cli`` runs the ``quorumfl`` command."""

from .main import main

main()
