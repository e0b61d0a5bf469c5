"""Built-in modifiers."""
