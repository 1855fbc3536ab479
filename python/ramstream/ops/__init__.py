"""ramstream.ops: the Python wrappers of the compiled core, one module per area."""
