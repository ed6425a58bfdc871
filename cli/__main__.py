"""`python -m cli ...` is `flywheel ...`."""

from cli.main import main

main()
