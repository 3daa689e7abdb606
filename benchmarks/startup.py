"""Start-up: the first `jaxsample run` on a machine against the second (warm caches).

Usage (from the repository root; CPU, the embedded SmolLM2-135M-Instruct):

    python -m benchmarks.startup --repeats 3 \
        --out benchmarks/results/startup.json
    python -m benchmarks.startup --repeats 3 --weights int8   # the int8 weights
    python -m benchmarks.startup --repeats 3 --python    # the Python quick start vs the CLI

Every measured call is a fresh process running

    python -m jaxsample run --prompt "What is 3 + 4? Answer with a number." \
        --n 8 --max-new-tokens 32 --seed 0 --json --quiet

with `JAXSAMPLE_CACHE_DIR` pointing at a directory of this benchmark (never
the user's cache). One repeat is five calls:

* `first`  an empty cache directory: the weights are dequantised from the
  GGUF and written to the weight cache, every program is traced, exported
  (`<cache>/exported/`) and compiled (`<cache>/xla/`);
* `second` the same directory again: the weights come back from the cache
  (a memory map of the safetensors entry), the programs from the exported
  entries (not traced) and the compilation cache;
* `first-plain`, `second-plain` the same two calls in another empty
  directory with `JAXSAMPLE_NO_EXPORTED=1`: the compilation cache alone,
  what the second call cost before the exported programs (the programs are
  traced and lowered again, then fetched);
* `no-cache` `--no-cache`: what every call cost before the caches (the GGUF
  is in the page cache by then, like the others).

Figures per call: `load` and `compile` (seconds, from the JSON `timings` the
command prints: loading the model; tracing, lowering and compiling or
fetching the compiled programs), `decode`, `total` in the process (from its
start of `main` to the result) and `wall` (the process, interpreter and
imports included, measured from outside). The breakdown of `compile` comes
from `jax.monitoring` duration events summed in the child (`WRAPPER`):
`trace` (jaxpr tracing), `lower` (jaxpr to StableHLO), `xla` (XLA compile,
or fetch from the compilation cache), of it `fetch` (the cache retrieval:
reading and deserialising the executable), and `read` (reading and
deserialising the exported programs). The table shows the median over the
repeats, and min-max. The decode itself is the same work in every call (it
is here to show that only start-up changes). The GGUF and the Python files
are read once before the first repeat, so every call finds them in the page
cache.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROMPT = "What is 3 + 4? Answer with a number."


# The child: `python -m jaxsample` with jax.monitoring's durations summed and
# printed on stderr after the command.
WRAPPER = r"""
import collections, json, sys
import jax
sums = collections.defaultdict(float)
jax.monitoring.register_event_duration_secs_listener(
    lambda event, seconds, **_: sums.__setitem__(event, sums[event] + seconds))
from jaxsample.cli import main
code = main(sys.argv[1:])
sys.stderr.write("\nBREAKDOWN " + json.dumps(sums) + "\n")
raise SystemExit(code)
"""

# The Python quick start's first block (README.md), run as its own process for
# `--python`: the engine object with its defaults (the compilation cache on).
QUICKSTART = """
from jaxsample import LLM, SamplingParams

llm = LLM("smollm2-135m-instruct", seed=0)
params = SamplingParams(n=8, temperature=0.8, top_p=0.95, max_tokens=32)
out = llm.chat([{"role": "user", "content": "What is 3 + 4? Answer with a number."}], params)
for branch in out[0].outputs:
    print(branch.text)
"""

PY_WRAPPER = r"""
import collections, json, sys, time
t0 = time.perf_counter()
import jax
sums = collections.defaultdict(float)
jax.monitoring.register_event_duration_secs_listener(
    lambda event, seconds, **_: sums.__setitem__(event, sums[event] + seconds))
import io, contextlib
buf = io.StringIO()
with contextlib.redirect_stdout(buf):
    exec(compile(sys.argv[1], "quickstart", "exec"), {})
total = time.perf_counter() - t0
sys.stderr.write("\nBREAKDOWN " + json.dumps(sums) + "\n")
print(json.dumps({"total": total, "texts": buf.getvalue().splitlines()}))
"""

EVENTS = {"trace": "/jax/core/compile/jaxpr_trace_duration",
          "lower": "/jax/core/compile/jaxpr_to_mlir_module_duration",
          "xla": "/jax/core/compile/backend_compile_duration",
          "fetch": "/jax/compilation_cache/cache_retrieval_time_sec",
          "read": "/jaxsample/exported/read_duration"}

KINDS = (("first", {}), ("second", {}), ("first-plain", {"JAXSAMPLE_NO_EXPORTED": "1"}),
         ("second-plain", {"JAXSAMPLE_NO_EXPORTED": "1"}), ("no-cache", None))


def command(args, no_cache: bool) -> list[str]:
    cmd = [sys.executable, "-c", WRAPPER, "run", "--prompt", PROMPT, "--n", str(args.n),
           "--max-new-tokens", str(args.max_new_tokens), "--seed", "0", "--json", "--quiet"]
    if args.model:
        cmd += ["--model", args.model]
    if args.weights:
        cmd += ["--weights", args.weights]
    if no_cache:
        cmd.append("--no-cache")
    return cmd


def call(args, cache_dir: pathlib.Path, no_cache: bool, extra_env=None) -> dict:
    env = {**os.environ, "JAXSAMPLE_CACHE_DIR": str(cache_dir)}  # cwd=ROOT: finds jaxsample
    env.pop("JAXSAMPLE_NO_CACHE", None)
    env.pop("JAXSAMPLE_NO_EXPORTED", None)
    env.update(extra_env or {})
    t0 = time.perf_counter()
    out = subprocess.run(command(args, no_cache), env=env, cwd=ROOT, capture_output=True,
                         text=True, timeout=1800)
    wall = time.perf_counter() - t0
    if out.returncode:
        raise SystemExit(f"jaxsample run failed ({out.returncode}): {out.stderr[-2000:]}")
    d = json.loads(out.stdout)
    t = d["timings"]
    sums = json.loads(out.stderr.rsplit("BREAKDOWN ", 1)[1])
    return {"load": t["load"], "compile": t["compile"], "prefill": t["prefill"],
            "decode": t["decode"], "total": t["total"], "wall": wall,
            **{k: sums.get(e, 0.0) for k, e in EVENTS.items()},
            "texts": [b["text"] for b in d["branches"]]}


def py_call(cache_dir: pathlib.Path) -> dict:
    """The quick start's first block in a fresh process (`QUICKSTART`)."""
    env = {**os.environ, "JAXSAMPLE_CACHE_DIR": str(cache_dir)}
    env.pop("JAXSAMPLE_NO_CACHE", None)
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", PY_WRAPPER, QUICKSTART], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=1800)
    wall = time.perf_counter() - t0
    if out.returncode:
        raise SystemExit(f"the quick start failed ({out.returncode}): {out.stderr[-2000:]}")
    d = json.loads(out.stdout.strip().splitlines()[-1])
    sums = json.loads(out.stderr.rsplit("BREAKDOWN ", 1)[1])
    return {"total": d["total"], "wall": wall, "texts": d["texts"],
            **{k: sums.get(e, 0.0) for k, e in EVENTS.items()}}


def python_main(args) -> int:
    """`--python`: the CLI's first and second run against the quick start's first
    block, first and second, each in its own cache directory, alternated per repeat."""
    calls = []
    for r in range(args.repeats):
        cli_dir = pathlib.Path(tempfile.mkdtemp(prefix="jaxsample-startup-"))
        py_dir = pathlib.Path(tempfile.mkdtemp(prefix="jaxsample-startup-"))
        try:
            for kind in ("cli-first", "py-first", "cli-second", "py-second"):
                if kind.startswith("cli"):
                    c = call(args, cli_dir, False)
                else:
                    c = py_call(py_dir)
                c.update(kind=kind, repeat=r)
                calls.append(c)
                if args.out:
                    _write(args.out, {"quickstart": QUICKSTART, "calls": calls})
                print(f"repeat {r} {kind:10s} wall {c['wall']:6.2f} s  total in process "
                      f"{c['total']:6.2f} s  xla {c['xla']:.2f} s", flush=True)
        finally:
            shutil.rmtree(cli_dir, ignore_errors=True)
            shutil.rmtree(py_dir, ignore_errors=True)
    med = {k: statistics.median(c["wall"] for c in calls if c["kind"] == k)
           for k in ("cli-first", "py-first", "cli-second", "py-second")}
    print("\n| call | wall, median (s) |\n|---|---|")
    for k, v in med.items():
        print(f"| {k} | {v:.2f} |")
    print(f"\nquick start second / CLI second: {med['py-second'] / med['cli-second']:.2f}x")
    return 0


def dir_bytes(path: pathlib.Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--model", default=None, help="default: the embedded model")
    p.add_argument("--weights", default=None, choices=["int8", "int8-weight-only"],
                   help="quantised weights (default: the model's float weights)")
    p.add_argument("--out", default=None, help="write every call as JSON here (after each call)")
    p.add_argument("--python", action="store_true",
                   help="the Python quick start's first block against the CLI (first and "
                        "second process each)")
    args = p.parse_args(argv)
    if args.python:
        return python_main(args)

    # Warm the page cache with the GGUF and the code (not what is measured).
    from jaxsample.models.checkpoints import registry

    gguf = pathlib.Path(args.model) if args.model else registry.embedded_path()
    gguf.read_bytes()
    load_avg = os.getloadavg() if hasattr(os, "getloadavg") else None
    calls = []
    for r in range(args.repeats):
        bases = {}
        try:
            for kind, extra in KINDS:
                group = kind.split("-")[-1] if kind.endswith("plain") else "exported"
                if group not in bases:
                    bases[group] = pathlib.Path(tempfile.mkdtemp(prefix="jaxsample-startup-"))
                c = call(args, bases[group], extra is None, extra)
                c.update(kind=kind, repeat=r)
                if kind.startswith("first"):
                    c["cache_bytes"] = {sub.name: dir_bytes(sub) for sub in bases[group].iterdir()}
                calls.append(c)
                if args.out:  # rewritten after every call: a run cut short keeps its calls
                    _write(args.out, {"env": _env(args, load_avg, calls), "calls": calls})
                print(f"repeat {r} {kind:12s} load {c['load']:6.2f} s  compile "
                      f"{c['compile']:6.2f} s (trace {c['trace']:.2f} lower {c['lower']:.2f} "
                      f"xla {c['xla']:.2f} fetch {c['fetch']:.2f} read {c['read']:.2f})  "
                      f"decode {c['decode']:6.2f} s  total {c['total']:6.2f} s  wall "
                      f"{c['wall']:6.2f} s", flush=True)
        finally:
            for b in bases.values():
                shutil.rmtree(b, ignore_errors=True)
    same = all(c["texts"] == calls[0]["texts"] for c in calls)
    print()
    print("| call | load (s) | compile (s) | load+compile (s) | decode (s) | total in process (s) "
          "| wall (s) |")
    print("|---|---|---|---|---|---|---|")
    for c in calls:
        c["load_compile"] = c["load"] + c["compile"]

    def cell(rows, key):
        v = [c[key] for c in rows]
        med = statistics.median(v)
        return f"{med:.2f} ({min(v):.2f}-{max(v):.2f})" if len(v) > 1 else f"{med:.2f}"

    kinds = [k for k, _ in KINDS]
    for kind in kinds:
        rows = [c for c in calls if c["kind"] == kind]
        print(f"| {kind} | {cell(rows, 'load')} | {cell(rows, 'compile')} | "
              f"{cell(rows, 'load_compile')} | {cell(rows, 'decode')} | {cell(rows, 'total')} | "
              f"{cell(rows, 'wall')} |")
    print()
    print("| call | trace (s) | lower (s) | xla: compile or fetch (s) | of it fetch (s) "
          "| read exported (s) |")
    print("|---|---|---|---|---|---|")
    for kind in kinds:
        rows = [c for c in calls if c["kind"] == kind]
        print(f"| {kind} | " + " | ".join(cell(rows, k) for k in EVENTS) + " |")
    med = {k: statistics.median(c["load_compile"] for c in calls if c["kind"] == k)
           for k in kinds}
    print(f"\nsecond/first load+compile: exported {med['second'] / med['first']:.1%}, "
          f"plain {med['second-plain'] / med['first-plain']:.1%}")
    first = [c for c in calls if c["kind"] == "first"][0]
    print("cache written by the first call: " + ", ".join(
        f"{k} {v / 2**20:.1f} MiB" for k, v in sorted(first["cache_bytes"].items())))
    print(f"same branch texts in every call: {same}")
    return 0


def _env(args, load_avg, calls) -> dict:
    env = {"python": platform.python_version(), "machine": platform.machine(),
           "cpus": os.cpu_count(), "load_average_at_start": load_avg,
           "command": "python -m jaxsample " + " ".join(command(args, False)[3:]),
           "same_texts_in_every_call": all(c["texts"] == calls[0]["texts"] for c in calls)}
    try:
        import importlib.metadata as md
        env.update(jax=md.version("jax"), jaxlib=md.version("jaxlib"))
    except Exception:  # noqa: BLE001
        pass
    return env


def _write(path, data) -> None:
    """Strict JSON, replaced atomically (a reader never sees half a file)."""
    tmp = pathlib.Path(f"{path}.tmp")
    tmp.write_text(json.dumps(data, indent=1, allow_nan=False))
    os.replace(tmp, path)


if __name__ == "__main__":
    raise SystemExit(main())
