"""The `jaxsample` command line, one file per concern.

    parser.py    the arguments (`build_parser`), their value types
    requests.py  what `run` is asked: prompts from flags, files, stdin or JSONL
                 lines (`read_requests`), checked against the model's context
                 before any weight is read (`check_requests`)
    app.py       `main`: the dispatch, `run` (load, sample, reduce) and `cache`
    console.py   what `run` prints: strict JSON (`dumps`), records, rich tables,
                 the exit statuses
    price.py     `price`: the analytic cost table from a config alone, its plot
    config.py    YAML run configs mapped onto frozen dataclasses (`load_config`)
    merge.py     `merge`: the parts of a multi-host run joined in request order

JAX is imported only when a model is needed, so `--help`, `--version` and
`price` with a named config answer immediately.
"""

from jaxsample.cli.app import main, resolve_run_config
from jaxsample.cli.console import branch_table, dumps
from jaxsample.cli.parser import build_parser
from jaxsample.cli.price import resolve_model_config
from jaxsample.cli.requests import Request, check_requests, read_requests

__all__ = ["main", "build_parser", "resolve_run_config", "resolve_model_config", "read_requests",
           "check_requests", "Request", "dumps", "branch_table"]
