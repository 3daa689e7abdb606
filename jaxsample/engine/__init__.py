"""The shared-prefix parallel decode engine.

Data flow of one request, one file per stage:

    inputs.py   prompts --tokenizer--> token ids [B] lists; every check made
                before any compute
    prefill.py  tokens [R, P] (right-padded to a bucket) --prefill, once per
                prompt--> PrefixCache k, v L x [R, K, P, D], last logits [R, V]
    context.py  with shared_prefix=: the context common to all prompts prefilled
                once (ContextCache k, v L x [K, C, D], no row or branch axis),
                then each prompt's suffix after it (context + causal suffix
                merged by log-sum-exp)
    step.py     one decode step of one branch, vmapped over the N slots
                (axis_name "branch") with the prefix unbatched: the prefix is
                read once per step for all branches; prefix / tail / current
                token merged by log-sum-exp (XLA's ops, or the Pallas kernels
                of `jaxsample.kernels`: `generate(attention=...)`)
    loop.py     a chunk: blocks of k guarded steps (an inner loop with a
                static trip count) until a traced t_stop (so every chunk
                size runs one program); fresh states;
                compaction (gather the live slots into smaller buckets); the
                pool's refill, insert and slot moves (between rows of a prompt);
                PROGRAMS, the compiled programs by static key and shapes
    exported.py the programs on disk as jax.export StableHLO (with the
                compilation cache on): a second process skips tracing
    placement.py  serving params, host <-> device copies, KV bytes, mesh
                shardings and shard_map wrappers
    budget.py   the pool's size from a KV budget (max_kv_bytes): what one row
                (prefix) and one slot (tail + decode buffers) hold, and the
                requests that can never run, refused before any compute
    session.py  a Session: the prompts validated, encoded and prefilled once
    scheduler.py  the pool's scheduler, host data only: which branch runs in
                which slot; between chunks the refills, row inserts and moves
                (a `Boundary`), and when the live branches compact (a
                `Compaction`)
    round.py    a Round, the pool's runner: one decode state [R, N, ...] over a
                session's rows, run in chunks; it applies the scheduler's plans
                (refill, insert with lazy prefill, moves, compaction) and copies
                each chunk's outputs to host arrays at (prompt, branch)
    buckets.py  shape buckets (prefix, tail, slots), plain Python
    stops.py    stop strings seen on the way (incremental detokenisation),
                cut exactly at the end
    api.py      generate() -> Generation (tokens/logprobs [B, N, T], texts, bill),
                and the host loop it shares with stream.py
    stream.py   stream(): the same loop, yielding text deltas per (prompt,
                branch) after each chunk, then the Generation
    requests.py run_pool: many requests in one pool, each result out as soon as it
                completes, with the run's Bill (its `pool` part)
    shard_requests.py  one process's contiguous share of the requests under
                jax.distributed, its global positions (keys) kept
    sampling/   token choice: logits processors, top-k / top-p / min-p, the draw
    step_cost.py  XLA's cost analysis of one compiled decode step

Letters: see `models/families/llama.py` and `state.py`. Keys: branch key =
fold_in(fold_in(key(seed), prompt_index), branch_index), folded with the
token index each step (levanter's discipline), so tokens depend neither on
the batch, the device mesh, the chunk size nor the slot a branch occupies.

The naive engine (`naive.naive_generate`) is the same code run on N materialised copies
of each prompt (what Hugging Face's `num_return_sequences` does): the baseline
of benchmarks and the oracle of tests.
"""

from jaxsample.engine.api import STOP_CHUNK, finish, generate
from jaxsample.engine.buckets import bucket, slot_bucket
from jaxsample.engine.loop import PROGRAMS, compact, decode_chunk, init_state
from jaxsample.engine.prefill import prefill
from jaxsample.engine.requests import Request, RequestResult, RequestRun, run_pool
from jaxsample.engine.round import Round
from jaxsample.engine.session import Session, serving_params
from jaxsample.engine.state import (
    MAX_STOP_IDS,
    ContextCache,
    DecodeState,
    Knobs,
    PrefixCache,
    Static,
)
from jaxsample.engine.step import branch_step
from jaxsample.engine.stream import StreamEvent, TextDelta, stream

# What users call. The other names imported above (prefill, decode_chunk,
# init_state, compact, branch_step, serving_params, PROGRAMS, bucket,
# slot_bucket, MAX_STOP_IDS, STOP_CHUNK) stay importable for the
# library's own modules, benchmarks and tests, but are not the public API.
__all__ = ["generate", "stream", "StreamEvent", "TextDelta", "finish", "Session", "Round",
           "PrefixCache", "ContextCache", "DecodeState", "Knobs", "Static", "Request",
           "RequestResult", "RequestRun", "run_pool"]
