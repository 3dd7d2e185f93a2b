"""`python -m openjev.tools.soak` (see the package's docstring)."""

from openjev.tools.soak.cli import main

if __name__ == "__main__":
    main()
