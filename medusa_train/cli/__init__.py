"""Command-line entry points (thin Hydra mains; the work is done in the library)."""
