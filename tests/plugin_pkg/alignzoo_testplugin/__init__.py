"""An outside plugin package: one component of every kind, registered through entry points."""
