"""``python -m quorumfl.cli`` runs the ``quorumfl`` command."""

from quorumfl.cli.main import main

main()
