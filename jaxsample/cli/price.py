"""`jaxsample price`: the analytic cost table from a model's config alone, and its plot."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from jaxsample import cost
from jaxsample.cli.console import EXIT_OK, dumps, stdout_console
from jaxsample.errors import InputError


def resolve_model_config(name: str | None):
    """A `LlamaConfig` for pricing, as cheaply as possible.

    Order: a name of the one name table with a published shape
    (`registry.PUBLISHED_SHAPES`, aliases resolved: the same names `run` takes);
    a config-only reader of `jaxsample.loading` if it offers one (no
    dequantisation); else the config of the fully loaded model.

    Raises:
      ModelLoadError / InputError: unknown name or unreadable checkpoint.
    """
    from jaxsample import loading
    from jaxsample.models.checkpoints import registry
    from jaxsample.models.families.llama import LlamaConfig

    key = registry.canonical_name(name or registry.DEFAULT_MODEL)
    if key in registry.PUBLISHED_SHAPES:
        return LlamaConfig(**registry.PUBLISHED_SHAPES[key]), key

    for attr in ("load_config", "read_config", "model_config"):
        reader = getattr(loading, attr, None)
        if callable(reader):
            cfg = reader(name) if name is not None else reader()
            cfg = getattr(cfg, "config", cfg)
            if isinstance(cfg, LlamaConfig) or hasattr(cfg, "family"):  # any model family
                return cfg, key or name or "embedded"
    lm = loading.load(name) if name is not None else loading.load()
    return lm.config, lm.name


def _short_flops(n: float) -> str:
    """2.5e12 -> '2.50T' (FLOPs, decimal prefixes), for narrow tables."""
    return cost.format_flops(n).replace(" ", "").replace("FLOP", "")


def _short_bytes(n: float) -> str:
    """1536 -> '1.5Ki' (bytes, binary prefixes), for narrow tables."""
    return cost.format_bytes(n).replace(" ", "").replace("B", "")


def price_command(args) -> int:
    if any(n < 1 for n in args.n):
        raise InputError(f"--n: branch counts must be >= 1, got {args.n}")
    if args.prompt_tokens < 0 or args.new_tokens < 0:
        raise InputError("--prompt-tokens and --new-tokens must be >= 0")
    if args.prompts < 1:
        raise InputError(f"--prompts: the number of prompts must be >= 1, got {args.prompts}")
    plot = _plot_target(args.plot) if args.plot else None  # before any work: bad paths fail fast
    model_cfg, label = resolve_model_config(args.model)
    dtype_bytes = cost.DTYPE_BYTES[args.dtype or model_cfg.dtype]
    P, T = args.prompt_tokens, args.new_tokens
    C, B = args.context_tokens, args.prompts
    levels = dict(context_tokens=C, num_prompts=B)
    rows = cost.table(model_cfg, P, T, args.n, dtype_bytes=dtype_bytes, **levels)
    head = cost.estimate(model_cfg, P, T, 1, dtype_bytes=dtype_bytes, **levels)
    if plot is not None:
        _plot(rows, plot, f"{label}: P={P}, T={T}, {dtype_bytes} bytes per element")
    if args.json:
        out = {"model": label, "config": dataclasses.asdict(model_cfg),
               "prompt_tokens": P, "new_tokens": T, "dtype_bytes": dtype_bytes,
               "context_tokens": C, "num_prompts": B,
               "n_params": head.n_params, "weight_bytes": head.weight_bytes,
               "kv_bytes_per_token": head.kv_bytes_per_token,
               "fits_context": C + P + T <= model_cfg.max_seq_len,
               "rows": rows, "estimates": [cost.estimate(model_cfg, P, T, n, dtype_bytes,
                                                         **levels).to_dict() for n in args.n]}
        if plot is not None:
            out["plot"] = str(plot)
        print(dumps(out))
        return EXIT_OK

    from rich import box
    from rich.table import Table

    console = stdout_console()
    fb = cost.format_bytes
    console.print(f"{label}: {head.n_params / 1e6:.1f}M parameters, weights "
                  f"{fb(head.weight_bytes)}, KV {fb(head.kv_bytes_per_token)}/token "
                  f"({dtype_bytes} bytes per element); P={P} prompt tokens, T={T} new tokens "
                  "per branch", markup=False)
    if C or B > 1:
        console.print(f"{B} prompts of P={P} own tokens after a C={C}-token context common to "
                      "all: shared = the context once, each prompt once, N tails per prompt; "
                      f"separate = {B} x N retries of C + P tokens", markup=False)
    if C + P + T > model_cfg.max_seq_len:
        what = "C + P + T" if C else "P + T"
        console.print(f"note: {what} = {C + P + T} exceeds the model's context "
                      f"({model_cfg.max_seq_len} tokens)", markup=False)
    table = Table(title="shared prefix (this engine) vs N separate retries, batched",
                  caption="FLOPs with decimal prefixes, bytes with binary ones (Ki, Mi, Gi)",
                  box=box.SIMPLE_HEAD)
    for col in ("N", "prefill\nshared", "prefill\nseparate", "decode\n(both)",
                "read/step\nshared", "read/step\nseparate", "KV held\nshared",
                "KV held\nseparate", "KV\nsaving"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(str(r["n"]), _short_flops(r["prefill_flops_shared"]),
                      _short_flops(r["prefill_flops_separate"]), _short_flops(r["decode_flops"]),
                      _short_bytes(r["step_bytes_shared"]), _short_bytes(r["step_bytes_separate"]),
                      _short_bytes(r["kv_bytes_shared"]),
                      _short_bytes(r["kv_bytes_separate"]), f"{r['kv_saving']:.1f}x")
    console.print(table)
    if C:
        console.print(f"the context prefixed to each prompt instead (two levels): prefill "
                      f"{_short_flops(rows[0]['prefill_flops_two_level'])} against "
                      f"{_short_flops(rows[0]['prefill_flops_shared'])} "
                      f"({rows[0]['prefill_flops_two_level'] / max(rows[0]['prefill_flops_shared'], 1):.1f}x)",
                      markup=False)
    console.print("Prefix sharing saves prefill FLOPs and prefix KV memory and reads; decode "
                  "FLOPs are the same either way. read/step: bytes the last decode step reads "
                  "(weights once + KV). Counting conventions: jaxsample/cost/model.py.", markup=False)
    if plot is not None:
        console.print(f"plot written to {plot}", markup=False, soft_wrap=True)  # a path whole
    return EXIT_OK


PLOT_EXTRA = "pip install 'jaxsample[plot]'"


def _plot_target(text: str) -> Path:
    """The file `price --plot` writes, exactly as it will be reported.

    A name without an extension gets ".png"; an extension picks the format
    (png, pdf, svg, ... whatever matplotlib writes).

    Raises:
      InputError: matplotlib is not installed (naming the extra that brings
        it), the path is a directory (or ends with a slash), its directory
        does not exist, or matplotlib cannot write that extension.
    """
    import os

    try:
        import matplotlib
    except ImportError:
        raise InputError(f"--plot needs matplotlib, which is not installed: {PLOT_EXTRA}") from None
    path = Path(text).expanduser()
    if text.endswith(("/", os.sep)) or path.is_dir():
        raise InputError(f"--plot: {text} is a directory; give a file name such as "
                         f"{path / 'price.png'}")
    if not path.suffix:
        path = path.with_name(path.name + ".png")
    if not path.parent.is_dir():
        raise InputError(f"--plot: directory {path.parent} does not exist")
    matplotlib.use("Agg")
    from matplotlib.backend_bases import FigureCanvasBase

    formats = FigureCanvasBase.get_supported_filetypes()
    if path.suffix[1:].lower() not in formats:
        raise InputError(f"--plot: cannot write {path.suffix!r} files; use one of "
                         f"{', '.join('.' + f for f in sorted(formats))} (or no extension "
                         "for .png)")
    return path


def _unit(values, kind: str) -> tuple[float, str]:
    """(divisor, unit) that puts the largest of `values` in [1, 1024) (bytes: KiB, MiB,
    GiB, TiB) or [1, 1000) (FLOPs: kFLOP ... PFLOP)."""
    top = max([abs(float(v)) for v in values] + [1.0])
    if kind == "bytes":
        units, base = ("B", "KiB", "MiB", "GiB", "TiB"), 1024.0
    else:
        units, base = ("FLOP", "kFLOP", "MFLOP", "GFLOP", "TFLOP", "PFLOP"), 1000.0
    k = 0
    while k + 1 < len(units) and top >= base ** (k + 1):
        k += 1
    return base ** k, units[k]


def _plot(rows, path: Path, title: str) -> None:
    """Three panels against N (log-log): KV cache held, bytes read by the last decode
    step, total FLOPs; shared prefix against separate retries. Each y axis is in one
    unit (MiB, GiB, GFLOP, ... chosen by its largest value); the N axis has a tick at
    each N priced and nowhere else."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    ns = [r["n"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    series = [
        ("KV cache held", "kv_bytes_shared", "kv_bytes_separate", "bytes"),
        ("bytes read by the last decode step", "step_bytes_shared", "step_bytes_separate",
         "bytes"),
        ("total FLOPs (prefill + decode)", "total_flops_shared", "total_flops_separate",
         "flops"),
    ]
    for ax, (name, shared, separate, kind) in zip(axes, series):
        values = [r[shared] for r in rows] + [r[separate] for r in rows]
        div, unit = _unit(values, kind)
        ax.plot(ns, [r[shared] / div for r in rows], "o-", label="shared prefix")
        ax.plot(ns, [r[separate] / div for r in rows], "s--", label="separate retries")
        if len(ns) > 1:
            ax.set_xscale("log", base=2)
        ax.xaxis.set_major_locator(FixedLocator(ns))
        ax.xaxis.set_minor_locator(NullLocator())
        ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:g}"))
        positive = [v / div for v in values if v > 0]
        if positive and max(positive) / min(positive) > 10:
            ax.set_yscale("log")
            ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:g}"))
            ax.yaxis.set_minor_formatter(FuncFormatter(lambda y, _: ""))
        ax.set_xlabel("branches N")
        ax.set_ylabel(unit)
        ax.set_title(f"{name} ({unit})", fontsize=10)
        ax.grid(True, which="major", alpha=0.3)
    axes[0].legend()
    fig.suptitle(title)
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=120, format=path.suffix[1:].lower())
    finally:
        plt.close(fig)
