"""`python -m jaxsample ...`: the same command line as the `jaxsample` script."""

from jaxsample.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
