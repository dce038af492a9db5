"""``isocost bench``: the load generator against any OpenAI-compatible endpoint."""
