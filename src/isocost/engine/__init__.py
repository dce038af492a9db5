"""The engine model (pure, clock passed in) and the ``isocost engine`` HTTP server."""
