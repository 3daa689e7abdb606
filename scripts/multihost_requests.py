"""Many requests over several processes (multi-host): each runs its share, writes its part.

Every process calls `jax.distributed.initialize`, reads the same request
list, takes its contiguous block (`engine.shard_requests.process_share`),
runs it on its own devices (`run_share`: request i keeps its keys, prompt
index i) and writes one `ResultsFile` part (`cli.merge.part_path`); then
`jaxsample merge --out OUT` joins the parts in request order. On a TPU pod or
a SLURM GPU cluster, `jax.distributed.initialize()` takes no arguments.

Usage (what tests/mesh/test_multihost_requests.py runs), CPU, loopback:
    python scripts/multihost_requests.py --out /tmp/out.jsonl --process-id 0 --port 12356 &
    python scripts/multihost_requests.py --out /tmp/out.jsonl --process-id 1 --port 12356
    jaxsample merge --out /tmp/out.jsonl        # /tmp/out.jsonl.part-0000{0,1}-of-00002
"""

from __future__ import annotations

import argparse
import os
import sys

PROMPTS = ["alpha", "the second prompt", "3 + 4 =", "a longer fourth prompt, with a comma",
           "five"]


def requests():
    """Five requests in two groups of equal params: the first group straddles the
    two processes' blocks ([0, 2) and [2, 5)), so request 2 runs on process 1 at
    local position 0 and must still draw with prompt index 2."""
    from jaxsample import SamplingParams
    from jaxsample.engine import Request

    a = SamplingParams(n=3, max_new_tokens=8, seed=7, top_p=0.95)
    b = SamplingParams(n=2, max_new_tokens=6, seed=7, temperature=0.8)
    return [Request(id=f"r{i}", prompt=p, params=a if i < 3 else b)
            for i, p in enumerate(PROMPTS)]


def result_line(res) -> dict:
    """One results line: id, global index, the branches' tokens and raw logprobs."""
    gen = res.generation
    return {"id": res.id, "index": res.index,
            "prompt_token_ids": [int(x) for x in gen.prompt_tokens[0]],
            "seed": gen.params.seed, "temperature": gen.params.temperature,
            "tokens": gen.tokens[0].tolist(), "logprobs": gen.logprobs[0].tolist(),
            "lengths": gen.lengths[0].tolist(), "texts": list(gen.texts[0])}


def run(lm, out: str, process_index: int, process_count: int) -> str:
    """Run this process's share and write its part; returns the part's path."""
    from jaxsample.cli.merge import part_path
    from jaxsample.cli.results_file import ResultsFile
    from jaxsample.engine.shard_requests import process_share, run_share

    share = process_share(requests(), process_index, process_count)
    path = part_path(out, share.process_index, share.process_count)
    with ResultsFile(path) as f:
        for res in run_share(lm, share, chunk_size=4):
            f.write(result_line(res))
    return path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--process-id", type=int, default=0)
    ap.add_argument("--num-processes", type=int, default=2)
    ap.add_argument("--port", type=int, default=12356)
    args = ap.parse_args()
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{args.port}",
                               num_processes=args.num_processes, process_id=args.process_id)
    from jaxsample.tiny import make_tiny_lm

    # process_share's defaults are jax.process_index() / jax.process_count()
    path = run(make_tiny_lm(), args.out, None, None)
    print(f"process {jax.process_index()} of {jax.process_count()} wrote {path}")


if __name__ == "__main__":
    main()
