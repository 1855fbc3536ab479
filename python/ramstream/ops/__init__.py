"""ramstream.ops: thin, validating Python wrappers around the compiled kernels, one module per area."""
