"""Pure domain layer: catalogs, the cost model, the VRAM ledger. No I/O, no clock, no RNG."""
