"""Built-in alignzoo components, registered through the same entry points as outside plugins."""
