"""ProbeX command-line tools (the `probex` console script) and shared helpers for them."""
