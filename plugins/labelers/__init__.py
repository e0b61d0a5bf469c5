"""Built-in labelers."""
