"""Plot benchmarks/decode.py results: decode tokens/s and peak memory against N, one line per
(engine, P).

    python -m benchmarks.plot benchmarks/results/cpu_smollm2.jsonl [more.jsonl ...] \
        --out benchmarks/results/cpu_smollm2.png
"""

from __future__ import annotations

import argparse
import json

STYLE = {"jaxsample": "-o", "naive": "--s", "hf": ":^"}


def load_cells(paths):
    cells = []
    for path in paths:
        with open(path) as f:
            for line in f:
                row = json.loads(line)
                if row.get("kind") == "cell" and "error" not in row:
                    cells.append(row)
    return cells


def plot(paths, out):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = load_cells(paths)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    series = sorted({(c["engine"], c["P"]) for c in cells}, key=lambda k: (k[1], k[0]))
    for eng, P in series:
        rows = sorted((c for c in cells if c["engine"] == eng and c["P"] == P),
                      key=lambda c: c["N"])
        ns = [c["N"] for c in rows]
        label = f"{eng} P={P}" + (" (decode only)" if rows[0].get("naive_prefill") == "tile" else "")
        ax1.plot(ns, [c["decode_tokens_per_s"] for c in rows], STYLE.get(eng, "-x"), label=label)
        mem = [(c.get("peak_bytes") or 0) / 2**20 for c in rows]
        ax2.plot(ns, mem, STYLE.get(eng, "-x"), label=label)
    for ax, title in ((ax1, "decode tokens/s (all branches)"),
                      (ax2, "peak memory of the call (MiB; CPU: RSS above the call's start)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("N branches")
        ax.set_title(title, fontsize=10)
        ax.grid(True, alpha=0.3)
    ax1.set_yscale("log")
    ax1.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("paths", nargs="+")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    plot(a.paths, a.out)


if __name__ == "__main__":
    main()
