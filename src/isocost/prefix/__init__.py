"""Pure: chained block hashes and the per-replica prefix index."""
