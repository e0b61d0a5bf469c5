"""Built-in environments (kind ``environment``): multi-turn episodes an arm trains on."""
