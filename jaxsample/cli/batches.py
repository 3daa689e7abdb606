"""One call of `run`: consecutive requests with equal settings (`group_requests`'s
batch) through `generate` or `adaptive_self_consistency`, and each request's result
(the vote, best-of-N or the adaptive rule's winner). Used by `app` (print at the end)
and `out_file` (a line per request as it completes).
"""

from __future__ import annotations

import contextlib
import time

from jaxsample.cli import config as config_lib
from jaxsample.cli.console import finite
from jaxsample.cli.parser import ADAPTIVE
from jaxsample.cli.requests import render
from jaxsample.errors import InputError


def make_mesh(mesh_cfg: config_lib.MeshConfig, n: int):
    """The ("data", "branch") mesh of the config, or None for one device."""
    if mesh_cfg.devices == 1:
        return None
    if n % mesh_cfg.branch:
        raise InputError(f"--n {n} must be a multiple of mesh.branch ({mesh_cfg.branch})")
    from jaxsample import sharding

    try:
        return sharding.make_mesh(branch=mesh_cfg.branch, data=mesh_cfg.data)
    except ValueError as e:
        raise InputError(f"mesh: {e}") from None


def run_batch(lm, cfg, args, batch, shared, progress, k, t_start, t_load, requests=None):
    """Run one call of consecutive requests with equal settings (`group_requests`'s batch
    k); the out dicts (`json_record`'s input) of its requests. `requests` are the indices
    of the whole batch (default: those of `batch`); `t_start` the time "total" counts from
    (default: this call's start)."""
    run_cfg = cfg.replace(sampling=batch[0].sampling)
    mesh = make_mesh(cfg.mesh, run_cfg.sampling.n)
    texts = [render(lm.tokenizer, r, cfg.chat) for r in batch]
    kwargs = {"chat": False, "prompt_index_offset": batch[0].index}
    if mesh is not None:
        kwargs["mesh"] = mesh
    t_batch = time.perf_counter()
    if args.adaptive:
        adaptive = run_adaptive(lm, texts, run_cfg, args, kwargs, progress)
        gen = adaptive.generation
        per = [adaptive_result(adaptive, b, args) for b in range(len(batch))]
    else:
        from jaxsample import engine

        adaptive = None
        if getattr(args, "kv_budget", None) is not None:
            kwargs["max_kv_bytes"] = args.kv_budget
        if shared is not None:  # the prompts after the common context
            # With chat, generate renders [system turn] + each conversation itself.
            kwargs.update(chat=cfg.chat, shared_prefix=shared)
            texts = [(r.messages if r.messages is not None else r.prompt) if cfg.chat
                     else render(lm.tokenizer, r, False) for r in batch]
        gen = engine.generate(lm, texts, run_cfg.sampling, progress=progress or False,
                              **kwargs)
        sc = vote(gen, cfg.reducer) if cfg.reducer.kind == "vote" else None
        per = [reduce_one(gen, cfg.reducer, b, sc) for b in range(len(batch))]
    timings = {"load": t_load,
               "compile": float(gen.timings.get("compile", 0.0)),
               "prefill": float(gen.timings.get("prefill", 0.0)),
               "decode": float(gen.timings.get("decode", 0.0)),
               "total": time.perf_counter() - (t_batch if t_start is None else t_start)}
    requests = [x.index for x in batch] if requests is None else requests
    return [dict(request=r, batch=k, gen=gen, b=b, result=result, answers=answers,
                 adaptive=adaptive, timings=timings, cfg=run_cfg, requests=requests)
            for b, (r, (result, answers)) in enumerate(zip(batch, per))]


def run_adaptive(lm, prompts, cfg, args, kwargs, progress=None):
    """`jaxsample.adaptive_self_consistency` for `run --adaptive`."""
    from jaxsample.reduce import adaptive as adaptive_lib

    rule, confidence = ADAPTIVE[args.adaptive]
    ctx = (progress.phase("adaptive self-consistency: rounds of "
                          f"{args.window} branches, up to {args.max_n}")
           if progress is not None else contextlib.nullcontext())
    with ctx:
        return adaptive_lib.adaptive_self_consistency(
            lm, prompts, cfg.sampling, max_n=args.max_n, window=args.window, rule=rule,
            threshold=args.threshold, confidence=confidence, extract=cfg.reducer.extract,
            warmup=2 * args.window if confidence else 16, progress=progress or False,
            **kwargs)


def adaptive_result(adaptive, b: int, args):
    counted = adaptive.counted[b]
    first = next((i for i, (a, c) in enumerate(zip(adaptive.answers[b], counted))
                  if c and a == adaptive.winner[b]), None)
    result = {"answer": adaptive.winner[b], "share": finite(adaptive.share[b]),
              "support": finite(adaptive.support[b]),  # the winner's (weighted) votes
              "branch": first, "n_used": int(adaptive.n_used[b]),
              "terminated": int(adaptive.terminated[b]), "adaptive": args.adaptive}
    return result, list(adaptive.answers[b])


def vote(gen, reducer: config_lib.ReducerConfig):
    from jaxsample import reduce as reducers

    return reducers.self_consistency(gen, extract=reducer.extract, weights=reducer.weights)


def reduce_one(gen, reducer: config_lib.ReducerConfig, b: int = 0, sc=None):
    """The result ({"answer", "share", "branch"}) of prompt b and each branch's extracted
    answer; `sc` is the batch's `self_consistency` (computed here if None)."""
    import numpy as np

    from jaxsample import reduce as reducers
    from jaxsample.reduce import answers as answers_lib

    texts = gen.texts[b]
    if reducer.kind == "vote":
        sc = vote(gen, reducer) if sc is None else sc
        branch = int(sc.first_branch[b])
        result = {"answer": sc.winner[b], "share": finite(sc.share[b]),
                  "support": finite(sc.support[b]), "branch": branch if branch >= 0 else None}
        return result, list(sc.answers[b])

    def one(text):
        a = answers_lib.extract(text, reducer.extract)
        return (answers_lib.normalize(a) or None) if a is not None else None

    answers = [one(t) for t in texts]
    if reducer.kind == "best":
        scores = reducers.branch_scores(gen, reducer.score)
        # Prefer complete branches (ended by a stop): a branch cut at max_new_tokens
        # may carry a truncated answer. Without any complete branch, take them all.
        lengths = np.asarray(gen.lengths)[b:b + 1]
        complete = np.array([[r == "stop" for r in gen.finish_reason[b]]]) & (lengths > 0)
        valid = complete if complete.any() else lengths > 0
        idx = int(reducers.best_of_n(np.asarray(scores)[b:b + 1], valid)[0])
        if idx < 0:
            return {"answer": None, "share": None, "branch": None}, answers
        return {"answer": answers[idx], "share": None, "branch": idx,
                "score": finite(scores[b, idx])}, answers
    return {"answer": None, "share": None, "branch": None}, answers
