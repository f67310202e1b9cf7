"""Small bundled tasks for demos, tests and benchmarks."""
