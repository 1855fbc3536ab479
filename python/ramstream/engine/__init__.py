"""The offload engine: buckets, copy streams, the engine thread, the read guard, state dicts."""
