"""`python -m jaxsample.cli ...`: the same command line as `python -m jaxsample`."""

from jaxsample.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
