"""The training engine: one run of one arm with one seed, and the experiment runner."""
