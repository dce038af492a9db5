"""``isocost serve``: the OpenAI-compatible gateway that routes by equal cost."""
