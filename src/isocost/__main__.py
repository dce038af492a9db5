"""``python -m isocost``: the ``isocost`` command (the gateway's shadow replays run it so)."""

from isocost.cli import main

main()
