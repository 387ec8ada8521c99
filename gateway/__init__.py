"""ProbeX gateway: the OpenAI-compatible monitoring proxy (talks to workers over HTTP only)."""
