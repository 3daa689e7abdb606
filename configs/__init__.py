"""Named run configurations: `jaxsample run --config NAME` reads `NAME.yaml` here.

The top-level folder installs as `jaxsample.configs` (pyproject.toml), so a
wheel carries the YAML files and a name resolves without a checkout.
"""
