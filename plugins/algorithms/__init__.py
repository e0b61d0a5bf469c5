"""Built-in algorithms."""
