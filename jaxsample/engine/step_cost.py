"""XLA's own count of what one compiled decode step reads: "read once", proven.

`decode_step_cost` lowers and compiles the engine's decode step for a model
config and (P prompt tokens, N branches, T new tokens), with abstract inputs
only (no weights, no data: `jax.ShapeDtypeStruct`s), and returns the
compiled program's `cost_analysis()`: bytes accessed and FLOPs. It does so
for the shared-prefix engine (one row of N slots over one prefix) and for the
naive engine (N rows of one slot, each with its own prefix copy, what
`generate(..., naive=True)` runs), beside the ideal bytes of one step
(`ideal_step_bytes`: the weights, the prefix once, N tails, N rows of logits).
A regression that silently broadcasts the prefix to the N branches shows as
shared bytes near the naive ones, without any accelerator or timing.

What is compiled: the loop body alone (`engine.step.make_step`, one sampled
token and one forward pass of every slot), jitted with the state donated,
exactly as it runs inside `loop.decode_chunk`'s loops. The body is
compiled on its own rather than the chunk because XLA's `HloCostAnalysis`
counts a `while` instruction as one pass of its body and condition whatever
the trip count (jaxlib 0.10.2 on CPU: a `fori_loop` of 10 or of a traced n
passes of an 8.4 MB body both count 16.8 MB, the body once plus the
loop's copy of its carry), which is right for one step but adds the loop's
own carry traffic; the body alone is the step. Two caveats of the counts,
both from XLA:

* A `conditional` counts as its most expensive branch. The step has three:
  the forward pass against "every slot done" (the forward pass is the
  step), and in `sampling.choose_token` the Gumbel draw against greedy and
  the top-k / top-p filters against "off" (`lax.cond` on traced knobs). The
  filters' branches are 32-pass bisections (`sampling.select._largest_key`) run as
  a `fori_loop`, i.e. a `while`, counted as one pass; so the count bounds a
  step with the filters on from below and a step without them from above,
  by the filters' branches (SmolLM2, N = 16: about 135 MB, some 40 passes
  over the `[N, V]` float32 logits).
* Bytes accessed is the sum over the optimised program's instructions of
  operand and output bytes (after fusion: a fused computation counts its
  inputs and outputs once). An in-place `dynamic-update-slice` counts the
  update, not the buffer; a `gather` counts its whole operand, so the
  embedding lookup of N > 1 tokens (a gather under the branch vmap) is
  charged the whole table (113 MB for SmolLM2) though it reads N rows.

Letters as in `models/families/llama.py`.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxsample import cost

__all__ = ["StepCost", "decode_step_cost", "ideal_step_bytes", "compile_decode_step",
           "HloLoop", "ProgramControl", "program_control"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepCost:
    """XLA's cost analysis of one compiled decode step.

    Attributes:
      engine: "shared" (one row of N slots, one prefix) or "naive" (N rows of
        one slot, N prefix copies).
      prompt_tokens, n, new_tokens: P (the prefix buffer length), N, T (the tail
        buffer length).
      bytes_accessed: bytes (`cost_analysis()["bytes accessed"]`).
      flops: FLOPs (`cost_analysis()["flops"]`; XLA counts a multiply-add as 2).
      ideal_bytes: `ideal_step_bytes` for the same (P, N, T).
      weight_bytes, prefix_bytes, tail_bytes, logits_bytes: the ideal's parts
        (bytes; the prefix once, N tails of T slots, N rows of V float32 logits).
    """

    engine: str
    prompt_tokens: int
    n: int
    new_tokens: int
    bytes_accessed: float
    flops: float
    ideal_bytes: int
    weight_bytes: int
    prefix_bytes: int
    tail_bytes: int
    logits_bytes: int

    @property
    def ratio_to_ideal(self) -> float:
        """bytes_accessed / ideal_bytes (1 is the limit; the naive engine is ~N x prefix)."""
        return self.bytes_accessed / self.ideal_bytes

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["ratio_to_ideal"] = self.ratio_to_ideal
        return d


def ideal_step_bytes(config, prompt_tokens: int, n: int, new_tokens: int) -> dict[str, int]:
    """The bytes one shared-prefix decode step must touch at least.

    Weights once (every parameter, `cost.weight_bytes`), the prefix KV once
    (P positions), N tails of T positions (the whole tail buffer: the step
    reads slots < t and masks the rest, so a full buffer is the fair bound
    for a fixed-shape program), and N rows of V float32 logits (written by the
    forward pass, read once by the sampling). From `cost.estimate`'s
    `decode_step_bytes_shared` (last step, context P + T) plus the logits.

    Args:
      config: a model config (`models.families.llama.LlamaConfig`, `Gemma3Config`).
      prompt_tokens, n, new_tokens: P >= 0, N >= 1, T >= 0.
    Returns:
      dict with "weights", "prefix", "tails", "logits", "total" (bytes).
    Raises:
      ValueError: as `cost.estimate`.
    """
    est = cost.estimate(config, prompt_tokens, new_tokens, n)
    w = est.weight_bytes
    prefix = cost.kv_bytes(config, prompt_tokens)
    tails = n * cost.kv_bytes(config, new_tokens)
    logits = n * config.vocab_size * 4
    assert w + prefix + tails == est.decode_step_bytes_shared
    return dict(weights=w, prefix=prefix, tails=tails, logits=logits,
                total=w + prefix + tails + logits)


def _abstract(tree):
    return jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tree)


def compile_decode_step(config, prompt_tokens: int, n: int, new_tokens: int, *,
                        naive: bool = False, vocab_limit: int | None = None,
                        signals: bool = False, top_logprobs: int = 0,
                        weights: str | None = None, mode: str | None = None,
                        chunk: bool = False, attention: str = "xla"):
    """The compiled decode step (`jax.stages.Compiled`) for abstract inputs.

    Args:
      config: a model config; its family module builds the parameter shapes.
      prompt_tokens: P, the prefix buffer length (an engine bucket in practice).
      n: N branches. Shared: one row of N slots; naive: N rows of one slot.
      new_tokens: T, the tail buffer length.
      naive: compile the naive engine's step (N prefix copies).
      vocab_limit: rows of the logits that may be sampled (default V).
      signals: compile the step that records the selection signals
        (`SamplingParams.signals`); off, the step is the plain one.
      top_logprobs: k of the top logprobs recorded per token (0: none; with
        k > 0 the ranks are recorded too, as `SamplingParams(logprobs=k)`).
      weights: None, or "int8" for `load(..., weights="int8")`'s parameters
        (`models.quantization.quant`), run in `mode` (default `quant.DEFAULT_MODE`).
      chunk: compile the whole chunk, `loop.decode_chunk` (the step inside its
        loops), with the engine's `loop.compiler_options` for the default
        backend, instead of the loop body alone.
      attention: the engine option (`kernels.resolve_attention`: "auto" is what
        a request gets by default on the default backend).
    Returns:
      `jax.stages.Compiled` of `step(params, prefix, state, knobs) -> state`
      (state donated), the loop body of `loop.decode_chunk` (or the chunk).
    Raises:
      ValueError: P < 1, N < 1 or T < 1.
    """
    from jaxsample.engine import init_state
    from jaxsample.engine.state import MAX_STOP_IDS, Knobs, PrefixCache, Static, prefix_kv_dtype
    from jaxsample.engine.step import branch_keys, make_step
    from jaxsample.models.families import families

    for name, v in (("prompt_tokens", prompt_tokens), ("n", n), ("new_tokens", new_tokens)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    fam = families.module_for(config)
    V = config.vocab_size
    vocab_limit = V if vocab_limit is None else vocab_limit
    R, slots = (n, 1) if naive else (1, n)
    from jaxsample import kernels

    st = Static(cfg=config, n=slots, t_cap=new_tokens, vocab_limit=vocab_limit, pad_id=0,
                top_logprobs=top_logprobs, token_ranks=top_logprobs > 0, signals=signals,
                attention=kernels.resolve_attention(attention, config))
    params = jax.eval_shape(
        lambda: fam.unstack_layers(fam.init_params(config, jax.random.key(0))))
    if weights is not None:
        from jaxsample.models.quantization import outliers, quant
        params = quant.quantize_params(params, compute=config.dtype, abstract=True,
                                       mode=mode or quant.DEFAULT_MODE,
                                       outliers=outliers.abstract_channels(params))
    dt = config.jnp_dtype
    K, D = config.n_kv_heads, config.head_dim
    from jaxsample.engine.prefill import window_extent

    pdt = prefix_kv_dtype(config, params) or dt  # as the engine stores it (W8A8: float16)
    pre = tuple(jax.ShapeDtypeStruct((R, K, window_extent(prompt_tokens, w), D), pdt)
                for w in config.layer_windows)
    prefix = PrefixCache(pre, pre, jax.ShapeDtypeStruct((R,), jnp.int32))
    state = jax.eval_shape(
        lambda: init_state(st, jnp.zeros((R, V), jnp.float32), jnp.zeros((R,), jnp.int32),
                           jnp.zeros((R, slots), jnp.int32), jnp.ones((R, slots), bool)))
    row = lambda d, *shape: jax.ShapeDtypeStruct((R,) + shape, d)
    knobs = Knobs(temperature=row(jnp.float32), top_k=row(jnp.int32), top_p=row(jnp.float32),
                  min_p=row(jnp.float32), seed=row(jnp.uint32), max_new_tokens=row(jnp.int32),
                  stop_ids=row(jnp.int32, MAX_STOP_IDS),
                  t_stop=jax.ShapeDtypeStruct((), jnp.int32), logit_bias=row(jnp.float32, 0),
                  min_tokens=row(jnp.int32), min_stop_ids=row(jnp.int32, MAX_STOP_IDS),
                  repetition_penalty=row(jnp.float32), frequency_penalty=row(jnp.float32),
                  presence_penalty=row(jnp.float32), processed_logprobs=row(jnp.bool_))

    def step(p, pf, s, kn):
        keys = branch_keys(kn, s.prompt_index, s.branch_ids)
        return make_step(st, p, pf, kn, keys)(s)

    options = None
    if chunk:
        from jaxsample.engine import loop

        step = lambda p, pf, s, kn: loop.decode_chunk(st, p, pf, s, kn)  # noqa: E731
        options = loop.compiler_options(jax.default_backend()) or None
    return jax.jit(step, donate_argnums=(2,)).lower(
        _abstract(params), prefix, _abstract(state), knobs).compile(options)


def _cost_dict(compiled) -> dict:
    ca = compiled.cost_analysis()
    if isinstance(ca, (list, tuple)):  # older jax: one dict per computation
        ca = ca[0]
    return ca


def decode_step_cost(config, prompt_tokens: int, n: int, new_tokens: int, *,
                     naive: bool = False, signals: bool = False,
                     top_logprobs: int = 0) -> StepCost:
    """Bytes accessed and FLOPs of one compiled decode step (see the module docstring).

    Args:
      config: a model config (`models.families.llama.LlamaConfig`, `Gemma3Config`).
      prompt_tokens: P, the prefix buffer length.
      n: N branches.
      new_tokens: T, the tail buffer length.
      naive: the naive engine (N rows with N prefix copies) instead of the shared one.
      signals, top_logprobs: as `compile_decode_step` (the step with the
        selection signals, or with the top-k logprobs, recorded).
    Returns:
      A `StepCost`.
    Raises:
      ValueError: P, N or T not a positive integer.
    """
    ca = _cost_dict(compile_decode_step(config, prompt_tokens, n, new_tokens, naive=naive,
                                        signals=signals, top_logprobs=top_logprobs))
    ideal = ideal_step_bytes(config, prompt_tokens, n, new_tokens)
    return StepCost(engine="naive" if naive else "shared", prompt_tokens=prompt_tokens, n=n,
                    new_tokens=new_tokens, bytes_accessed=float(ca["bytes accessed"]),
                    flops=float(ca["flops"]), ideal_bytes=ideal["total"],
                    weight_bytes=ideal["weights"], prefix_bytes=ideal["prefix"],
                    tail_bytes=ideal["tails"], logits_bytes=ideal["logits"])


# ---------------------------------------------------------------------------
# The loops and conditionals of an optimised HLO module (what runs step by step)

_COMPUTATION = re.compile(r"^(?:ENTRY )?%([\w.\-]+) .*\{$")
_CALLEES = re.compile(r"\b(?:condition|body|calls|to_apply|true_computation|false_computation)"
                      r"=%([\w.\-]+)")
_BRANCHES = re.compile(r"\bbranch_computations=\{([^}]*)\}")
_MATMUL = re.compile(r" (?:dot|convolution)\(|custom_call_target=\"[^\"]*(?:gemm|matmul|_dot)")


@dataclasses.dataclass(frozen=True)
class HloLoop:
    """One `while` of an optimised HLO module.

    Attributes:
      name: the instruction's name.
      trip_count: XLA's `known_trip_count` (the backend config of the optimised
        HLO), or None: then every pass reads its predicate (on a GPU, outside a
        command buffer, a copy to the host and a wait).
      matmuls: matrix products (dots, convolutions, GEMM custom calls) its body
        runs in each pass, not counting those of loops nested in it.
      captured: it lies inside a GPU command buffer (a `command_buffer`
        computation of XLA's command buffer scheduling), so a CUDA graph runs it.
    """

    name: str
    trip_count: int | None
    matmuls: int
    captured: bool


@dataclasses.dataclass(frozen=True)
class ProgramControl:
    """The control flow XLA kept in a compiled program (`program_control`).

    loops: every `while`; conditionals: the number of `conditional`s, and
    conditionals_captured: how many of them lie inside a command buffer
    (the others read their predicate on the host on a GPU).
    """

    loops: tuple[HloLoop, ...]
    conditionals: int
    conditionals_captured: int

    def step_loops(self) -> tuple[HloLoop, ...]:
        """The loops whose own body runs matrix products: the model's forward pass."""
        return tuple(loop for loop in self.loops if loop.matmuls)


def program_control(text: str) -> ProgramControl:
    """Reads the loops and conditionals of an optimised HLO module's text
    (`compiled.as_text()`): which loops have a trip count XLA knows, which of them
    run the model's matrix products, and what lies inside GPU command buffers.

    Raises:
      ValueError: the text holds no HLO computation.
    """
    comps: dict[str, list[str]] = {}
    name = None
    for line in text.splitlines():
        m = _COMPUTATION.match(line)
        if m:
            name = m.group(1)
            comps[name] = []
        elif line.startswith("}"):
            name = None
        elif name is not None and " = " in line:
            comps[name].append(line)
    if not comps:
        raise ValueError("program_control: no HLO computation in the text")

    def callees(line: str) -> list[str]:
        out = _CALLEES.findall(line)
        for group in _BRANCHES.findall(line):
            out += [c.strip().lstrip("%") for c in group.split(",") if c.strip()]
        return [c for c in out if c in comps]

    def matmuls(comp: str, seen: set) -> int:  # products reached without entering a loop
        if comp in seen:
            return 0
        seen.add(comp)
        n = 0
        for line in comps[comp]:
            if " while(" in line:
                continue
            n += bool(_MATMUL.search(line)) + sum(matmuls(c, seen) for c in callees(line))
        return n

    captured: set[str] = set()

    def capture(comp: str):
        if comp not in captured:
            captured.add(comp)
            for line in comps[comp]:
                for c in callees(line):
                    capture(c)

    for comp in comps:
        if comp.startswith("command_buffer"):
            capture(comp)
    loops, conds, conds_in = [], 0, 0
    for comp, lines in comps.items():
        for line in lines:
            if " while(" in line:
                trip = re.search(r'"known_trip_count":\{"n":"(\d+)"', line)
                body = re.search(r"\bbody=%([\w.\-]+)", line)
                loops.append(HloLoop(
                    name=line.split("=", 1)[0].split()[-1].lstrip("%"),
                    trip_count=int(trip.group(1)) if trip else None,
                    matmuls=matmuls(body.group(1), set()) if body and body.group(1) in comps
                    else 0,
                    captured=comp in captured))
            elif " conditional(" in line:
                conds += 1
                conds_in += comp in captured
    return ProgramControl(tuple(loops), conds, conds_in)
