"""How bytes move: the YAML pipeline spec, its stages, the runner, restore and the CLI front end."""
