"""What the tiers share to serve a request: the worker base, the messages between tiers,
route hints and worker ids, which faults a request survives, and the delta channel."""
