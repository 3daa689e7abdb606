"""Two-process (multi-host) generation on loopback, CPU devices, gloo collectives.

The path to TPU pods and multi-host GPU: every process calls
`jax.distributed.initialize`, builds the same ("data", "branch") mesh over all
processes' devices, and calls `generate` with the same arguments. Each
process prints the tokens as JSON on its last line.

Usage (what tests/mesh/test_distributed.py runs):
    python scripts/distributed_demo.py --process-id 0 --num-processes 2 --port 12355 &
    python scripts/distributed_demo.py --process-id 1 --num-processes 2 --port 12355
    python scripts/distributed_demo.py --single      # the unsharded reference
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--process-id", type=int, default=0)
    ap.add_argument("--num-processes", type=int, default=2)
    ap.add_argument("--port", type=int, default=12355)
    ap.add_argument("--local-devices", type=int, default=2)
    ap.add_argument("--single", action="store_true", help="unsharded reference run")
    args = ap.parse_args()
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.local_devices}"
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    import jax

    if not args.single:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(coordinator_address=f"127.0.0.1:{args.port}",
                                   num_processes=args.num_processes, process_id=args.process_id)
    from jaxsample import SamplingParams, engine, sharding
    from jaxsample.lm import LanguageModel
    from jaxsample.models.checkpoints.tokenizer import ByteTokenizer
    from jaxsample.models.families import llama

    cfg = llama.LlamaConfig(vocab_size=264, dim=32, n_layers=2, n_heads=4, n_kv_heads=2,
                            head_dim=8, ffn_dim=64, max_seq_len=256)
    lm = LanguageModel(config=cfg, params=llama.init_params(cfg, jax.random.key(0), 0.3),
                       tokenizer=ByteTokenizer(258, (256,), 257), name="tiny")
    mesh = None
    if not args.single:
        n_dev = len(jax.devices())
        mesh = sharding.make_mesh(branch=n_dev // 2, data=2)
    params = SamplingParams(n=8, max_new_tokens=12, seed=5, top_p=0.9)
    gen = engine.generate(lm, ["first prompt", "the second one"], params, mesh=mesh)
    print(json.dumps({"process": jax.process_index(), "devices": len(jax.devices()),
                      "tokens": gen.tokens.tolist(), "logprobs": gen.logprobs.tolist(),
                      "lengths": gen.lengths.tolist(), "prompt_tokens": gen.prompt_tokens,
                      "seed": gen.params.seed, "temperature": gen.params.temperature,
                      "vocab_size": cfg.vocab_size}))


if __name__ == "__main__":
    main()
