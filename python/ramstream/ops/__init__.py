"""ramstream.ops: one module per kernel area (validation in Python, work in ramstream._C)."""
