"""``python -m isocost``: the ``isocost`` command (the gateway's shadow replays run it so)."""

from isocost.cli import main

if __name__ == "__main__":  # imported (a walk over the package), it runs nothing
    main()
