"""Chat templates rendered as untrusted code.

A checkpoint's chat template (GGUF `tokenizer.chat_template`, a Hugging Face
`tokenizer_config.json`) is a jinja2 program from the file. It is rendered the
way `transformers` renders it (jinja2's `ImmutableSandboxedEnvironment`,
`trim_blocks`, `lstrip_blocks`, `loopcontrols`, `raise_exception`, `tojson`,
`strftime_now`), which keeps it away from Python's internals, and within
bounds, so that no template can hang a run or exhaust its memory:

* time: one render (and one compile) has `RENDER_SECONDS` of wall-clock time,
  checked at every loop iteration (each `{% for %}`'s iterable is wrapped in
  `bounded_iter`), call, filter, operator, attribute access and output chunk;
* size: no value a template builds, and not its output, may print to more
  than `limit` characters (`SIZE_BASE` plus `SIZE_PER_INPUT` times the
  characters of the messages). Growth is priced before it is computed:
  `*`, `+` and `%` on strings and lists, `~` (rewritten into `bounded_concat`),
  `str.format` / `|format`, `replace` and `join`, and any value printed by
  `{{ }}`; every result is measured after (`printed_size`);
* numbers: an int given to a call or filter (a width, a count, an indent) is
  at most `MAX_INT_ARG`; an int built by `*` or `**` at most `MAX_INT_BITS`
  bits; `range` at most `MAX_RANGE` items (jinja2's own cap);
* recursion: macros and recursive loops nest at most `MAX_DEPTH` calls deep;
* the source: at most `SOURCE_LIMIT` characters.

`lipsum` and the filters whose Python code can take minutes on one long text
(`striptags`, `urlize`: quadratic regular expressions; `wordwrap`: textwrap at
width 1) are not offered; `sum` adds numbers only (adding lists copies them
each time). Anything a template does wrong, or past a bound, is a
`TemplateFailure` (what happened, one line), which the tokenizer reports as a
`ModelLoadError` naming the file.

Source: jinja2's sandbox (jinja2.palletsprojects.com/en/stable/sandbox/), and
transformers' `utils/chat_template_utils.py` (the environment and its globals).
"""

from __future__ import annotations

import datetime
import functools
import json
import re
import threading
import time

import jinja2
import jinja2.nodes
import jinja2.sandbox
import jinja2.visitor

RENDER_SECONDS = 2.0  # wall-clock time of one compile or render
SOURCE_LIMIT = 1 << 20  # characters of a template's source
SIZE_BASE = 1 << 20  # characters any value, and the output, may print to ...
SIZE_PER_INPUT = 4  # ... plus this many times the characters of the messages
MAX_INT_ARG = 65536  # the largest int a call or filter takes (widths, counts, indents)
MAX_INT_BITS = 1 << 16  # bits of an int that * or ** may build
MAX_RANGE = jinja2.sandbox.MAX_RANGE  # items of range()
MAX_DEPTH = 64  # nested calls (macros, recursive loops)
MAX_INDENT = 64  # tojson's indent


class TemplateFailure(Exception):
    """A chat template failed or went past a bound; the message says which, in one line."""


class _Budget:
    def __init__(self, seconds: float, limit: int):
        self.deadline = time.monotonic() + seconds
        self.seconds, self.limit, self.depth = seconds, limit, 0

    def tick(self) -> None:
        if time.monotonic() > self.deadline:
            raise TemplateFailure(f"it ran longer than {self.seconds:g} s")

    def size(self, value, what: str) -> None:
        if printed_size(value, self.limit) > self.limit:
            raise TemplateFailure(f"{what} would hold more than {self.limit:,} characters")


_local = threading.local()


def _budget() -> _Budget:
    b = getattr(_local, "budget", None)
    if b is None:  # a template function called outside `render` / `compile_template`
        raise TemplateFailure("a template's function was called outside its render")
    return b


def printed_size(value, cap: int) -> int:
    """About how many characters `str(value)` has (at least that many for strings,
    lists, tuples, sets and dicts, counted to just past `cap` and no further, so the
    cost is bounded even for a structure that holds itself)."""
    total, stack = 0, [value]
    while stack and total <= cap:
        x = stack.pop()
        if isinstance(x, str):
            total += len(x)
        elif isinstance(x, bool) or x is None:
            total += 4
        elif isinstance(x, int):
            total += x.bit_length() * 3 // 10 + 1
        elif isinstance(x, (list, tuple, set, frozenset)):
            total += 2 + 2 * len(x)
            stack.extend(x)
        elif isinstance(x, dict):
            total += 2 + 4 * len(x)
            stack.extend(x.keys())
            stack.extend(x.values())
        elif isinstance(x, jinja2.utils.Namespace):
            total += 16
            stack.append(dict(x._Namespace__attrs))  # noqa: SLF001  (what its repr prints)
        else:
            total += 32
    return total


def bounded_iter(iterable):
    """A `{% for %}` loop's iterable (the template's For nodes are rewritten to call
    this): the time is checked at every item."""
    budget = _budget()
    for x in iterable:
        budget.tick()
        yield x


def bounded_concat(*parts) -> str:
    """The `~` operator (the template's Concat nodes are rewritten to call this): the
    pieces' printed size checked before they are joined."""
    budget = _budget()
    budget.tick()
    budget.size(list(parts), "a ~ concatenation")
    return "".join(str(p) for p in parts)


# printf conversions: flags, width, precision (a `*` takes them from the arguments).
_PRINTF = re.compile(r"%[#0\- +]*(\*|\d+)?(?:\.(\*|\d+))?[a-zA-Z%]")
# str.format fields' specs: a nested field ({:{w}}) takes the width from the arguments.
_FORMAT_SPEC = re.compile(r"\{[^{}]*:([^{}]*(\{[^{}]*\})?[^{}]*)\}")


def _format_size(fmt: str, args, budget: _Budget, printf: bool) -> int:
    """An upper bound of the characters `fmt % args` (printf) or `fmt.format(*args)`
    prints, refusing widths taken from the arguments."""
    size = len(fmt) + printed_size(list(args), budget.limit)
    pattern = _PRINTF if printf else _FORMAT_SPEC
    for m in pattern.finditer(fmt):
        spec = m.group(0) if printf else m.group(1)
        if ("*" in spec) if printf else m.group(2) is not None:
            raise TemplateFailure("a format takes its width from its arguments")
        size += sum(int(d) for d in re.findall(r"\d+", spec)) + 400  # 400: a float's digits
    return size


def _materialize(value):
    """An iterator (a generator of `map`, `select`, ...) as a list of at most MAX_RANGE
    items, so its size can be priced before a call consumes it; anything else as is."""
    if not hasattr(value, "__next__"):
        return value
    budget, items, size = _budget(), [], 0
    for x in bounded_iter(value):
        size += printed_size(x, budget.limit) + 2
        if len(items) >= MAX_RANGE or size > budget.limit:
            raise TemplateFailure(f"an iterable has more than {MAX_RANGE} items or "
                                  f"{budget.limit:,} characters")
        items.append(x)
    return items


def _check_args(args, kwargs, budget: _Budget, what: str) -> None:
    for v in list(args) + list(kwargs.values()):
        if isinstance(v, int) and not isinstance(v, bool) and abs(v) > MAX_INT_ARG:
            raise TemplateFailure(f"{what} was given {v}, more than {MAX_INT_ARG}")
        budget.size(v, f"an argument of {what}")


def _growth(name: str, obj, args, kwargs, budget: _Budget) -> None:
    """The size of what a growing call (replace, join, format) would build, before it
    is built."""
    if name == "replace" and len(args) >= 2 and isinstance(obj, str):
        old, new = str(args[0]), str(args[1])
        count = len(obj) + 1 if old == "" else obj.count(old)
        size = len(obj) + count * max(0, len(new) - len(old))
    elif name == "join" and args and isinstance(args[0], (str, list, tuple, dict)):
        items = args[0]
        size = printed_size(items, budget.limit) + len(str(obj)) * len(items)
    else:
        return
    if size > budget.limit:
        raise TemplateFailure(f"{name} would build more than {budget.limit:,} characters")


class BoundedSandbox(jinja2.sandbox.ImmutableSandboxedEnvironment):
    """jinja2's immutable sandbox with the module docstring's bounds on the operators,
    calls, attribute access and output (`finalize`)."""

    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def call_binop(self, context, operator, left, right):
        budget = _budget()
        budget.tick()
        if operator in ("*", "**") and all(isinstance(x, int) and not isinstance(x, bool)
                                           for x in (left, right)):
            bits = (left.bit_length() + right.bit_length() if operator == "*"
                    else left.bit_length() * right if right > 0 and abs(left) > 1 else 0)
            if bits > MAX_INT_BITS:
                raise TemplateFailure(f"{left} {operator} {right} has more than "
                                      f"{MAX_INT_BITS} bits")
        elif operator == "*":
            seq, n = (left, right) if isinstance(right, int) else (right, left)
            if isinstance(n, int) and isinstance(seq, (str, list, tuple)):
                if printed_size(seq, budget.limit) * max(n, 0) > budget.limit:
                    raise TemplateFailure(f"a repetition would hold more than "
                                          f"{budget.limit:,} characters")
        elif operator == "+" and not isinstance(left, (int, float)):
            budget.size([left, right], "a + concatenation")
        elif operator == "%" and isinstance(left, str):
            args = right if isinstance(right, tuple) else (right,)
            if _format_size(left, args, budget, printf=True) > budget.limit:
                raise TemplateFailure(f"a % format would print more than {budget.limit:,} "
                                      "characters")
        result = super().call_binop(context, operator, left, right)
        budget.size(result, f"the result of {operator}")
        return result

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja2's signature)
        budget = _budget()
        budget.tick()
        target = getattr(__obj, "__wrapped__", __obj)  # str.format: the sandbox's wrapper
        name = getattr(target, "__name__", "a function")
        name = "range" if name == "safe_range" else name
        owner = getattr(target, "__self__", None)
        if name in ("striptags", "unescape"):
            raise TemplateFailure(f"{name} is not offered")
        if name in ("format", "format_map") and isinstance(owner, str):
            if _format_size(owner, list(args) + list(kwargs.values()), budget,
                            printf=False) > budget.limit:
                raise TemplateFailure(f"a format would print more than {budget.limit:,} "
                                      "characters")
            for v in list(args) + list(kwargs.values()):
                budget.size(v, "an argument of format")
        else:
            if name == "join" and isinstance(owner, str) and args:
                args = (_materialize(args[0]),) + args[1:]
            _check_args(args, kwargs, budget, name)
            _growth(name, owner, args, kwargs, budget)
        if budget.depth >= MAX_DEPTH:
            raise TemplateFailure(f"calls nest deeper than {MAX_DEPTH} (a recursive macro?)")
        budget.depth += 1
        try:
            result = super().call(__context, __obj, *args, **kwargs)
        finally:
            budget.depth -= 1
        budget.size(result, f"the result of {name}")
        return result

    def getattr(self, obj, attribute):
        _budget().tick()
        return super().getattr(obj, attribute)

    def getitem(self, obj, argument):
        _budget().tick()
        return super().getitem(obj, argument)


def _bounded_filter(name: str, fn):
    """A filter under the bounds: its arguments (ints at most MAX_INT_ARG; `format`'s
    widths), its growth (`replace`, `join`) and its result's size."""

    @functools.wraps(fn)
    def bounded(*args, **kwargs):
        budget = _budget()
        budget.tick()
        k = 1 if getattr(fn, "jinja_pass_arg", None) is not None else 0  # a context first
        if len(args) > k:  # the filtered value: an iterator read into a list first
            args = args[:k] + (_materialize(args[k]),) + args[k + 1:]
        plain = list(args[k:])
        if name == "format" and plain and isinstance(plain[0], str):
            if _format_size(plain[0], plain[1:] + list(kwargs.values()), budget,
                            printf=True) > budget.limit:
                raise TemplateFailure(f"|format would print more than {budget.limit:,} "
                                      "characters")
        else:
            _check_args(plain[1:], kwargs, budget, f"|{name}")
            budget.size(plain[0] if plain else None, f"the input of |{name}")
            if name == "replace":
                _growth("replace", str(plain[0]), plain[1:], kwargs, budget)
            elif name == "join" and plain:
                _growth("join", plain[1] if len(plain) > 1 else kwargs.get("d", ""),
                        plain[:1], {}, budget)
            elif name == "indent" and plain:
                width = plain[1] if len(plain) > 1 else kwargs.get("width", 4)
                width = width if isinstance(width, int) else len(str(width))
                lines = str(plain[0]).count("\n") + 1
                if width * lines > budget.limit:
                    raise TemplateFailure(f"|indent would build more than {budget.limit:,} "
                                          "characters")
        result = fn(*args, **kwargs)
        budget.size(result, f"the result of |{name}")
        return result

    return bounded


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    """transformers' `tojson` (non-ASCII kept, optional indent), its indent at most
    MAX_INDENT."""
    if indent is not None and (isinstance(indent, bool) or not isinstance(indent, (int, str))
                               or (isinstance(indent, int) and not 0 <= indent <= MAX_INDENT)
                               or (isinstance(indent, str) and len(indent) > MAX_INDENT)):
        raise TemplateFailure(f"tojson's indent must be an int in [0, {MAX_INDENT}], got "
                              f"{str(indent)[:40]}")
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _sum(iterable, attribute=None, start=0):
    """jinja2's `sum` for numbers only (a sum of lists or strings copies each time)."""
    total = start
    for x in bounded_iter(iterable):
        if attribute is not None:
            x = x.get(attribute) if isinstance(x, dict) else getattr(x, attribute)
        if isinstance(x, bool) or not isinstance(x, (int, float)):
            raise TemplateFailure(f"|sum adds numbers, got {type(x).__name__}")
        total += x
    return total


def _raise_exception(message):
    raise jinja2.TemplateError(message)


def _strftime_now(fmt):
    return datetime.datetime.now().strftime(str(fmt)[:256])


def _finalize(value):
    """Every `{{ }}` value: its printed size checked before it becomes text."""
    _budget().size(value, "a printed value")
    return value


class _Rewrite(jinja2.visitor.NodeTransformer):
    """For loops' iterables through `bounded_iter`, `~` through `bounded_concat`
    (imported by name, so a template cannot shadow them)."""

    def visit_For(self, node):
        node = self.generic_visit(node)
        node.iter = jinja2.nodes.Call(jinja2.nodes.ImportedName(f"{__name__}.bounded_iter"),
                                      [node.iter], [], None, None, lineno=node.lineno)
        return node

    def visit_Concat(self, node):
        node = self.generic_visit(node)
        return jinja2.nodes.Call(jinja2.nodes.ImportedName(f"{__name__}.bounded_concat"),
                                 list(node.nodes), [], None, None, lineno=node.lineno)


def _environment() -> BoundedSandbox:
    env = BoundedSandbox(trim_blocks=True, lstrip_blocks=True, finalize=_finalize,
                         extensions=["jinja2.ext.loopcontrols"])
    for name in ("striptags", "urlize", "wordwrap"):
        env.filters.pop(name, None)
    env.filters["tojson"] = _tojson
    env.filters["sum"] = _sum
    env.filters = {name: _bounded_filter(name, fn) for name, fn in env.filters.items()}
    env.globals.pop("lipsum", None)
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now)
    return env


def _guarded(budget: _Budget, fn, *args, **kwargs):
    """`fn(*args, **kwargs)` under `budget`; every failure a TemplateFailure."""
    _local.budget = budget
    try:
        return fn(*args, **kwargs)
    except TemplateFailure:
        raise
    except jinja2.TemplateError as e:
        raise TemplateFailure(" ".join(str(e).split()) or type(e).__name__) from None
    except RecursionError:
        raise TemplateFailure("it nests too deeply (Python's recursion limit)") from None
    except MemoryError:
        raise TemplateFailure("it ran out of memory") from None
    except Exception as e:  # noqa: BLE001  (1/0, a type error, ...: the template's fault)
        msg = " ".join(str(e).split())[:200]
        raise TemplateFailure(f"{type(e).__name__}: {msg}" if msg else type(e).__name__) from None
    finally:
        _local.budget = None


def compile_template(source: str) -> jinja2.Template:
    """The template compiled under the bounds (`SOURCE_LIMIT`, `RENDER_SECONDS`).

    Raises:
      TemplateFailure: not a string, too long, or it does not compile (syntax).
    """
    if not isinstance(source, str):
        raise TemplateFailure(f"the template must be a string, got {type(source).__name__}")
    if len(source) > SOURCE_LIMIT:
        raise TemplateFailure(f"the template has {len(source):,} characters, more than "
                              f"{SOURCE_LIMIT:,}")
    env = _environment()

    def build():
        tree = _Rewrite().visit(env.parse(source))
        return env.from_string(tree)

    return _guarded(_Budget(RENDER_SECONDS, SIZE_BASE), build)


def render(template: jinja2.Template, messages, **context) -> str:
    """`template` rendered with `messages` and `context` under the bounds.

    Raises:
      TemplateFailure: the template raised (`raise_exception`, 1/0, ...) or went past
        a bound (time, size, numbers, recursion).
    """
    limit = SIZE_BASE + SIZE_PER_INPUT * printed_size(messages, 1 << 40)
    budget = _Budget(RENDER_SECONDS, limit)

    def run():
        out, total = [], 0
        for chunk in template.generate(messages=messages, **context):
            budget.tick()
            total += len(chunk)
            if total > limit:
                raise TemplateFailure(f"its output would be longer than {limit:,} characters")
            out.append(chunk)
        return "".join(out)

    return _guarded(budget, run)
