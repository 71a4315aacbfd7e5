"""The models the benches serve, built in code (no downloads), and their request bodies."""
