"""Run configurations: small YAML files that map onto frozen dataclasses.

A file in `configs/` names everything a run needs besides the prompt::

    model:    {name: null, dtype: float32}        # null: the embedded model
    sampling: {n: 16, temperature: 0.8, top_p: 0.95, max_new_tokens: 128, seed: 0}
    reducer:  {kind: vote, extract: number, weights: null, score: mean_logprob}
    mesh:     {data: 1, branch: 1}
    chat: true

Every section and every key is optional; what is missing takes the defaults
below (the command line's defaults). Unknown keys, repeated keys (at any
depth; PyYAML would keep the last silently), wrong types and values outside
the allowed set raise `ConfigError` naming the file, the key and the allowed
values (for a repeated key: both lines). The `sampling` section is validated by
`jaxsample.SamplingParams` itself.

Fields of the sections:

    model.name        str or null   a model name or a checkpoint path (null: embedded)
    model.dtype       float32 | bfloat16
    model.weights     null | int8 | int8-weight-only   (`load(weights=...)`, models/quantization/)
    model.prefix_kv_dtype  auto | model   the prompts' stored KV dtype (`load(prefix_kv_dtype=...)`)
    model.cpu_kernels auto | off          the int8 products' CPU kernels (`load(cpu_kernels=...)`)
    sampling.*        the fields of SamplingParams: n, temperature, top_k, top_p,
                      min_p, max_new_tokens (or vLLM's max_tokens), stop_token_ids,
                      stop, seed, logprobs, min_tokens, ignore_eos, presence_penalty,
                      frequency_penalty, repetition_penalty, logit_bias
                      ({token_id: bias}), prompt_logprobs
    reducer.kind      vote (self-consistency) | best (best-of-N) | none
    reducer.extract   number | boxed | choice | text | auto   (answer extraction, vote)
    reducer.weights   null | mean_logprob                     (vote weights)
    reducer.score     mean_logprob | sum_logprob | self_certainty | tail_confidence |
                      lowest_group_confidence | bottom_group_confidence  (best-of-N score;
                      the last four need sampling.signals: true, which --select sets)
    mesh.data         int >= 1, devices along the prompt axis ("data")
    mesh.branch       int >= 1, devices along the branch axis ("branch")
    chat              bool, render prompts with the model's chat template

References: gemma and the flax examples (frozen, keyword-only config
dataclasses); vLLM `SamplingParams` (field names).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import yaml

import jaxsample.configs as _named_configs
from jaxsample.errors import ConfigError, short_repr
from jaxsample.sampling_params import FOREIGN_KEYWORDS

DTYPES = ("float32", "bfloat16")
WEIGHTS = (None, "int8", "int8-weight-only")  # jaxsample.loading.WEIGHTS
PREFIX_KV_DTYPES = ("auto", "model")  # jaxsample.lm.PREFIX_KV_DTYPES
CPU_KERNELS = ("auto", "off")  # jaxsample.lm.CPU_KERNELS
REDUCER_KINDS = ("vote", "best", "none")
EXTRACT_KINDS = ("number", "boxed", "choice", "text", "auto")
VOTE_WEIGHTS = (None, "mean_logprob")
SCORES = ("mean_logprob", "sum_logprob", "self_certainty", "tail_confidence",
          "lowest_group_confidence", "bottom_group_confidence")  # reducers.SCORE_NAMES
SIGNAL_SCORES = SCORES[2:]  # need SamplingParams(signals=True)

# The command line's sampling defaults; a config's `sampling` section overrides them.
DEFAULT_SAMPLING = dict(n=16, temperature=0.8, top_k=0, top_p=0.95, min_p=0.0,
                        max_new_tokens=128, seed=0)

CONFIG_DIR = Path(_named_configs.__file__).resolve().parent  # configs/, installed as jaxsample.configs


def _sampling_params_cls():
    from jaxsample.sampling_params import SamplingParams  # lazily: keeps `import config` cheap
    return SamplingParams


def default_sampling():
    """`SamplingParams` with the command line's defaults (n=16, temperature=0.8, ...)."""
    return _sampling_params_cls()(**DEFAULT_SAMPLING)


def _fmt(allowed) -> str:
    return ", ".join("null" if a is None else str(a) for a in allowed)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Which model to load.

    Attributes:
      name: a model name or checkpoint path; None for the embedded default.
      dtype: "float32" or "bfloat16" (weights and activations).
      weights: None (weights in `dtype`), "int8" or "int8-weight-only"
        (`jaxsample.load(weights=...)`).
      prefix_kv_dtype: "auto" or "model", the dtype each prompt's KV cache is
        stored in (`jaxsample.LanguageModel.prefix_kv_dtype`: "auto" is float16
        for an int8 W8A8 float32 model on the CPU kernels, "model" the model's dtype).
      cpu_kernels: "auto" or "off", whether the int8 products may run as the
        CPU kernels (`jaxsample.LanguageModel.cpu_kernels`).
    """

    name: str | None = None
    dtype: str = "float32"
    weights: str | None = None
    prefix_kv_dtype: str = "auto"
    cpu_kernels: str = "auto"

    def __post_init__(self):
        if self.name is not None and (not isinstance(self.name, str) or not self.name):
            raise ConfigError("model.name must be null or a non-empty string, got "
                              f"{short_repr(self.name)}")
        if self.dtype not in DTYPES:
            raise ConfigError(f"model.dtype must be one of {_fmt(DTYPES)}, got "
                              f"{short_repr(self.dtype)}")
        if self.weights not in WEIGHTS:
            raise ConfigError(f"model.weights must be one of {_fmt(WEIGHTS)}, got "
                              f"{short_repr(self.weights)}")
        for name, allowed in (("prefix_kv_dtype", PREFIX_KV_DTYPES),
                              ("cpu_kernels", CPU_KERNELS)):
            value = getattr(self, name)
            if not isinstance(value, str) or value not in allowed:
                hint = " (YAML reads a bare off as false: write 'off')" if value is False else ""
                raise ConfigError(f"model.{name} must be one of {_fmt(allowed)}, got "
                                  f"{short_repr(value)}{hint}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReducerConfig:
    """How the N branches become one answer.

    Attributes:
      kind: "vote" (self-consistency: majority vote over extracted answers),
        "best" (best-of-N by `score`) or "none" (keep all branches).
      extract: answer extraction for the vote: "number", "boxed" (LaTeX
        \\boxed{}), "choice" (A-E), "text" (the whole stripped text) or "auto".
      weights: None (one vote per branch) or "mean_logprob" (votes weighted
        by the branch's length-normalised probability).
      score: best-of-N score, one of `SCORES` (`jaxsample.reduce.branch_scores`).
    """

    kind: str = "vote"
    extract: str = "number"
    weights: str | None = None
    score: str = "mean_logprob"

    def __post_init__(self):
        for name, allowed in (("kind", REDUCER_KINDS), ("extract", EXTRACT_KINDS),
                              ("weights", VOTE_WEIGHTS), ("score", SCORES)):
            value = getattr(self, name)
            if value not in allowed or isinstance(value, bool):
                raise ConfigError(f"reducer.{name} must be one of {_fmt(allowed)}, got "
                                  f"{short_repr(value)}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class MeshConfig:
    """Device mesh: `data` devices along the prompts, `branch` along the branches.

    `data * branch` devices are used; 1 x 1 means no mesh (one device). The
    number of branches N must be a multiple of `branch`.
    """

    data: int = 1
    branch: int = 1

    def __post_init__(self):
        for name in ("data", "branch"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"mesh.{name} must be an integer >= 1, got {short_repr(value)}")

    @property
    def devices(self) -> int:
        return self.data * self.branch


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunConfig:
    """Everything a run needs besides the prompt.

    Attributes:
      model: `ModelConfig`.
      sampling: `jaxsample.SamplingParams`.
      reducer: `ReducerConfig`.
      mesh: `MeshConfig`.
      chat: render prompts with the model's chat template.
    """

    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    sampling: Any = dataclasses.field(default_factory=default_sampling)
    reducer: ReducerConfig = dataclasses.field(default_factory=ReducerConfig)
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    chat: bool = True

    def __post_init__(self):
        if not isinstance(self.chat, bool):
            raise ConfigError(f"chat must be true or false, got {short_repr(self.chat)}")

    def replace(self, **changes) -> "RunConfig":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """A plain dict in the YAML layout (tuples as lists); `from_dict` inverts it."""
        def plain(x):
            d = dataclasses.asdict(x)
            return {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}
        return {"model": plain(self.model), "sampling": plain(self.sampling),
                "reducer": plain(self.reducer), "mesh": plain(self.mesh), "chat": self.chat}


_SECTIONS = {"model": ModelConfig, "reducer": ReducerConfig, "mesh": MeshConfig}
_TOP_KEYS = ("model", "sampling", "reducer", "mesh", "chat")


def from_dict(data: Any, source: str = "config") -> RunConfig:
    """Build a `RunConfig` from a dict in the YAML layout.

    Args:
      data: a mapping (None is the empty mapping).
      source: what to name in error messages (the file path).
    Returns:
      The `RunConfig`.
    Raises:
      ConfigError: an unknown key, a wrong type or a value outside the allowed
        set; the message names `source`, the key and the allowed values.
    """
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: the top level must be a mapping with keys "
                          f"{', '.join(_TOP_KEYS)}, got {type(data).__name__}")
    for key in data:
        if key not in _TOP_KEYS:
            raise ConfigError(f"{source}: unknown key {short_repr(key)}; allowed keys: "
                              f"{', '.join(_TOP_KEYS)}")
    kwargs: dict[str, Any] = {}
    for key, cls in _SECTIONS.items():
        if key in data:
            kwargs[key] = _section(cls, data[key], key, source)
    if "sampling" in data:
        kwargs["sampling"] = _sampling(data["sampling"], source)
    if "chat" in data:
        kwargs["chat"] = data["chat"]
    try:
        return RunConfig(**kwargs)
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None


def _section(cls, values: Any, key: str, source: str):
    names = [f.name for f in dataclasses.fields(cls)]
    if values is None:
        values = {}
    if not isinstance(values, dict):
        raise ConfigError(f"{source}: {key} must be a mapping with keys {', '.join(names)}, "
                          f"got {short_repr(values)}")
    for k in values:
        if k not in names:
            raise ConfigError(f"{source}: unknown key {key}.{k}; allowed keys: {', '.join(names)}")
    try:
        return cls(**values)
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None


def _sampling(values: Any, source: str):
    cls = _sampling_params_cls()
    names = [f.name for f in dataclasses.fields(cls)]
    if values is None:
        values = {}
    if not isinstance(values, dict):
        raise ConfigError(f"{source}: sampling must be a mapping with keys {', '.join(names)}, "
                          f"got {short_repr(values)}")
    for k in values:
        if k in FOREIGN_KEYWORDS:
            raise ConfigError(f"{source}: sampling.{k}: {FOREIGN_KEYWORDS[k]}")
        if k not in names:
            raise ConfigError(f"{source}: unknown key sampling.{k}; allowed keys: "
                              f"{', '.join(names)}")
    defaults = dict(DEFAULT_SAMPLING)
    if values.get("max_tokens") is not None:  # vLLM's name for the budget replaces the default
        defaults.pop("max_new_tokens")
    merged = {**defaults, **values}
    merged = {k: tuple(v) if isinstance(v, list) else v for k, v in merged.items()}
    try:
        return cls(**merged)
    except (ValueError, TypeError) as e:  # ConfigError is a ValueError
        raise ConfigError(f"{source}: sampling: {e}") from None


class DuplicateKeyError(yaml.constructor.ConstructorError):
    """A YAML mapping repeats a key (raised by `StrictSafeLoader`).

    Attributes:
      key: the dotted path of the repeated key ("sampling.n"; list items as [i]).
      line, first_line: 1-based lines of the repeat and of the first occurrence.
    """

    def __init__(self, key: str, mark, first_mark):
        self.key, self.line, self.first_line = key, mark.line + 1, first_mark.line + 1
        super().__init__(None, None, f"duplicate key {key!r} at line {self.line}, column "
                                     f"{mark.column + 1} (first defined at line "
                                     f"{self.first_line}, column {first_mark.column + 1})", mark)


MAX_YAML_NODES = 10_000  # nodes of a config document with its aliases expanded


class AliasExpansionError(yaml.constructor.ConstructorError):
    """A YAML document whose aliases expand beyond `MAX_YAML_NODES` nodes, or refer to
    themselves (raised by `StrictSafeLoader`, before anything is constructed)."""

    def __init__(self, problem: str, mark):
        super().__init__(None, None, problem, mark)


class StrictSafeLoader(yaml.SafeLoader):
    """`yaml.SafeLoader` that refuses a key repeated in one mapping, at any depth,
    and aliases that expand to a huge document.

    PyYAML keeps the last value of a repeated key silently; YAML 1.2 says keys
    are unique. Keys are compared after construction (`1` and `0x1` are the
    same key). Keys brought in by a merge (`<<: *base`) may be overridden:
    that is what merges are for.

    Anchors and aliases (`&base`, `*base`, `<<: *base`) are allowed, but the
    document with every alias expanded may hold at most `MAX_YAML_NODES` nodes
    (a run config holds a few dozen), and an alias inside its own anchor (a
    recursive structure) is refused: a 400-byte "billion laughs" file (nested
    aliases, 10**9 nodes expanded) is refused at once instead of growing into a
    gigabyte-sized value and error message. The count is made on the composed
    node graph (each node counted once per path that reaches it, memoised by
    node), so it costs time linear in the file.
    """

    def construct_document(self, node):
        self._check_expansion(node)
        self._paths = {}
        self._record_paths(node, "")
        return super().construct_document(node)

    def _check_expansion(self, root) -> None:
        sizes: dict[int, int] = {}  # id(node) -> nodes under it, aliases expanded
        open_: set[int] = set()  # nodes being counted (an alias to one is a cycle)

        def size(node) -> int:
            key = id(node)
            if key in sizes:
                return sizes[key]
            if key in open_:
                raise AliasExpansionError("an alias refers to a node that contains it (a "
                                          "recursive structure); a config cannot use one",
                                          node.start_mark)
            open_.add(key)
            total = 1
            if isinstance(node, yaml.SequenceNode):
                children = node.value
            elif isinstance(node, yaml.MappingNode):
                children = [n for pair in node.value for n in pair]
            else:
                children = ()
            for child in children:
                total += size(child)
                if total > MAX_YAML_NODES:
                    raise AliasExpansionError(
                        f"the document expands to more than {MAX_YAML_NODES} nodes with its "
                        "aliases (*name) expanded (nested aliases, a \"billion laughs\"); a "
                        "run config holds a few dozen", node.start_mark)
            open_.discard(key)
            sizes[key] = total
            return total

        size(root)

    def _record_paths(self, node, path: str):
        if id(node) in self._paths:  # an alias seen before (or a recursive structure)
            return
        self._paths[id(node)] = path
        if isinstance(node, yaml.MappingNode):
            for key_node, value_node in node.value:
                key = key_node.value if isinstance(key_node, yaml.ScalarNode) else "?"
                self._record_paths(value_node, f"{path}.{key}" if path else str(key))
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                self._record_paths(item, f"{path}[{i}]")

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, Any] = {}  # key -> mark of its first occurrence
            path = getattr(self, "_paths", {}).get(id(node), "")
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    first = seen.get(key)
                except TypeError:  # an unhashable key: SafeLoader reports it
                    break
                if first is not None:
                    name = f"{path}.{key}" if path else str(key)
                    raise DuplicateKeyError(name, key_node.start_mark, first)
                seen[key] = key_node.start_mark
        return super().construct_mapping(node, deep=deep)


def resolve_path(name_or_path: str | os.PathLike) -> Path:
    """A config path, or a bare name looked up in the named configs (`configs/`,
    installed as `jaxsample.configs`).

    `"vote"` and `"vote.yaml"` find `configs/vote.yaml` when no such file
    exists in the working directory.
    """
    path = Path(name_or_path)
    if path.exists() or path.parent != Path("."):
        return path
    stem = path.name[:-5] if path.name.endswith(".yaml") else path.name
    candidate = CONFIG_DIR / f"{stem}.yaml"
    return candidate if candidate.exists() else path


def load_config(path: str | os.PathLike) -> RunConfig:
    """Read a YAML run configuration.

    Args:
      path: a `.yaml` file, or the name of one in `configs/` (e.g. "vote").
    Returns:
      The `RunConfig`; missing sections and keys take the defaults.
    Raises:
      ConfigError: the file is missing or unreadable, is not valid YAML,
        repeats a key in one mapping at any depth (the message names the
        file, the dotted key and both lines), or has an unknown key, a wrong
        type or a value outside the allowed set (the message names the file,
        the key and the allowed values).
    """
    p = resolve_path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        names = sorted(q.stem for q in CONFIG_DIR.glob("*.yaml")) if CONFIG_DIR.is_dir() else []
        hint = f" (named configs: {', '.join(names)})" if names else ""
        raise ConfigError(f"{path}: config file not found{hint}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: cannot read config file: {e}") from None
    try:
        data = yaml.load(text, Loader=StrictSafeLoader)  # noqa: S506  (a SafeLoader)
    except DuplicateKeyError as e:
        raise ConfigError(f"{p}: {e.problem}") from None
    except AliasExpansionError as e:
        raise ConfigError(f"{p}: line {e.problem_mark.line + 1}: {e.problem}") from None
    except RecursionError:  # thousands of nested [ or {: PyYAML composes recursively
        raise ConfigError(f"{p}: invalid YAML: nested too deeply") from None
    except yaml.YAMLError as e:
        where = getattr(e, "problem_mark", None)
        at = f" (line {where.line + 1}, column {where.column + 1})" if where else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"{p}: invalid YAML{at}: {problem}") from None
    return from_dict(data, source=str(p))
