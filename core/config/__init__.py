"""The experiment file: its schema (pydantic), the loader with located errors, the JSON Schema."""
