"""The runtime: the one inspection of a live model (inspect.py), the plan wrap() applies and its
check of each step's size against it (tokens.py)."""
