"""Built-in backends."""
