"""The experiment file: its schema (pydantic), the loader with located errors (its steps:
reading the YAML, overrides and sweeps, building components, the cross-checks, locating a
problem), the JSON Schema."""
