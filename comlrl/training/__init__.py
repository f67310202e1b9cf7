"""The training machinery every trainer shares: the loop and the optimizer-step component."""
