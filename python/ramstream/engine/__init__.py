"""The offload engine: gradient intake, updater, weight return and parallel strategy (see core.py)."""
