"""Start-up: the first `jaxsample run` on a machine against the second (warm caches).

Usage (from the repository root; CPU, the embedded SmolLM2-135M-Instruct):

    python -m benchmarks.startup --repeats 3 \
        --out benchmarks/results/startup.json

Every measured call is a fresh process running

    python -m jaxsample run --prompt "What is 3 + 4? Answer with a number." \
        --n 8 --max-new-tokens 32 --seed 0 --json --quiet

with `JAXSAMPLE_CACHE_DIR` pointing at a directory of this benchmark (never
the user's cache). One repeat is three calls:

* `first`  an empty cache directory: the weights are dequantised from the
  GGUF and written to the weight cache, every program is compiled and
  written to JAX's persistent compilation cache;
* `second` the same directory again: the weights come back from the cache
  (a memory map of the safetensors entry), the programs from the
  compilation cache;
* `no-cache` `--no-cache`: what every call cost before the caches (the GGUF
  is in the page cache by then, like the other two).

Figures per call: `load` and `compile` (seconds, from the JSON `timings` the
command prints: loading the model; tracing, lowering and compiling or
fetching the compiled programs), `decode`, `total` in the process (from its
start of `main` to the result) and `wall` (the process, interpreter and
imports included, measured from outside). The table shows the median over
the repeats, and min-max. The decode itself is the same work in every call
(it is here to show that only start-up changes). The GGUF and the Python
files are read once before the first repeat, so every call finds them in
the page cache.
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


def command(args, no_cache: bool) -> list[str]:
    cmd = [sys.executable, "-m", "jaxsample", "run", "--prompt", PROMPT, "--n", str(args.n),
           "--max-new-tokens", str(args.max_new_tokens), "--seed", "0", "--json", "--quiet"]
    if args.model:
        cmd += ["--model", args.model]
    if no_cache:
        cmd.append("--no-cache")
    return cmd


def call(args, cache_dir: pathlib.Path, no_cache: bool) -> dict:
    env = {**os.environ, "JAXSAMPLE_CACHE_DIR": str(cache_dir)}  # cwd=ROOT: `-m` finds jaxsample
    env.pop("JAXSAMPLE_NO_CACHE", None)
    t0 = time.perf_counter()
    out = subprocess.run(command(args, no_cache), env=env, cwd=ROOT, capture_output=True,
                         text=True, timeout=1800)
    wall = time.perf_counter() - t0
    if out.returncode:
        raise SystemExit(f"jaxsample run failed ({out.returncode}): {out.stderr[-2000:]}")
    d = json.loads(out.stdout)
    t = d["timings"]
    return {"load": t["load"], "compile": t["compile"], "prefill": t["prefill"],
            "decode": t["decode"], "total": t["total"], "wall": wall,
            "texts": [b["text"] for b in d["branches"]]}


def dir_bytes(path: pathlib.Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--model", default=None, help="default: the embedded model")
    p.add_argument("--out", default=None, help="write every call as JSON here")
    args = p.parse_args(argv)

    # Warm the page cache with the GGUF and the code (not what is measured).
    from jaxsample.models import registry

    gguf = pathlib.Path(args.model) if args.model else registry.embedded_path()
    gguf.read_bytes()
    load_avg = os.getloadavg() if hasattr(os, "getloadavg") else None
    calls = []
    for r in range(args.repeats):
        base = pathlib.Path(tempfile.mkdtemp(prefix="jaxsample-startup-"))
        try:
            for kind, no_cache in (("first", False), ("second", False), ("no-cache", True)):
                c = call(args, base, no_cache)
                c.update(kind=kind, repeat=r)
                if kind == "first":
                    c["cache_bytes"] = {sub.name: dir_bytes(sub) for sub in base.iterdir()}
                calls.append(c)
                print(f"repeat {r} {kind:8s} load {c['load']:6.2f} s  compile "
                      f"{c['compile']:6.2f} s  decode {c['decode']:6.2f} s  total "
                      f"{c['total']:6.2f} s  wall {c['wall']:6.2f} s", flush=True)
        finally:
            shutil.rmtree(base, ignore_errors=True)
    same = all(c["texts"] == calls[0]["texts"] for c in calls)
    env = {"python": platform.python_version(), "machine": platform.machine(),
           "cpus": os.cpu_count(), "load_average_at_start": load_avg,
           "command": " ".join(command(args, False)[1:]), "same_texts_in_every_call": same}
    try:
        import importlib.metadata as md
        env.update(jax=md.version("jax"), jaxlib=md.version("jaxlib"))
    except Exception:  # noqa: BLE001
        pass
    print()
    print("| call | load (s) | compile (s) | decode (s) | total in process (s) | wall (s) |")
    print("|---|---|---|---|---|---|")
    for kind in ("first", "second", "no-cache"):
        rows = [c for c in calls if c["kind"] == kind]

        def cell(key):
            v = [c[key] for c in rows]
            med = statistics.median(v)
            return f"{med:.2f} ({min(v):.2f}-{max(v):.2f})" if len(v) > 1 else f"{med:.2f}"

        print(f"| {kind} | {cell('load')} | {cell('compile')} | {cell('decode')} | "
              f"{cell('total')} | {cell('wall')} |")
    first = [c for c in calls if c["kind"] == "first"][0]
    print(f"\ncache written by the first call: " + ", ".join(
        f"{k} {v / 2**20:.0f} MiB" for k, v in sorted(first["cache_bytes"].items())))
    print(f"same branch texts in every call: {same}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"env": env, "calls": calls}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
