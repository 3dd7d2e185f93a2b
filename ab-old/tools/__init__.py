"""Command-line tools: the CLI client, the demo model, launching a local pair, soak and benchmarks."""
