"""The `flywheel` command: the top floor. It may import any package (lazily, inside each command);
nothing imports it."""
