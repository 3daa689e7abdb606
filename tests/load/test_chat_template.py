"""Untrusted checkpoint metadata: chat templates rendered within bounds
(models/checkpoints/chat_template.py), special token ids checked against the vocabulary, lone
surrogates refused by `encode`.

A template that loops for ever, recurses, divides by zero or builds a huge value is one
`ModelLoadError` naming the file, within seconds; a template that does none of that renders
exactly what jinja2's own sandbox renders (the oracle)."""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import time

import gguf
import jinja2
import jinja2.sandbox
import pytest
from checkpoint_files import rewrite_gguf
from paths import DATA

from jaxsample.errors import InputError, ModelLoadError
from jaxsample.models.checkpoints import chat_template
from jaxsample.models.checkpoints.gguf_loader import read_gguf
from jaxsample.models.checkpoints.tokenizer import CheckpointTokenizer

TINY_GGUF = DATA / "tiny_llama.gguf"
MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def meta():
    return dict(read_gguf(TINY_GGUF)[1])


def _tokenizer(meta, template, source="evil.gguf"):
    return CheckpointTokenizer.from_gguf_metadata({**meta, "tokenizer.chat_template": template},
                                                  source)


HOSTILE = {
    # the reproductions
    "nested ranges": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}"
                     "{% endfor %}",
    "nested loops under the range cap": "{% for i in range(60000) %}{% for j in range(60000) %}"
                                        "{% endfor %}{% endfor %}",
    "recursive macro": "{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}",
    "division by zero": "{{ 1/0 }}",
    "huge repetition": "{{ 'x' * 10**11 }}",
    "tojson indent": "{{ messages|tojson(indent=10**9) }}",
    # growth by other operators, filters and methods
    "doubling by ~": "{% set ns = namespace(s='x') %}{% for i in range(64) %}"
                     "{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s|length }}",
    "doubling by +": "{% set ns = namespace(s=['x']) %}{% for i in range(64) %}"
                     "{% set ns.s = ns.s + ns.s %}{% endfor %}{{ ns.s|length }}",
    "nested lists printed": "{% set ns = namespace(l=['x' * 100000]) %}{% for i in range(40) %}"
                            "{% set ns.l = [ns.l, ns.l] %}{% endfor %}{{ ns.l }}",
    "center filter": "{{ 'x'|center(1000000000) }}",
    "ljust method": "{{ 'x'.ljust(1000000000) }}",
    "format method width": "{{ '{:>999999999}'.format(1) }}",
    "printf width": "{{ '%999999999d' % 1 }}",
    "printf width from arguments": "{{ '%*d' % (999999999, 1) }}",
    "format filter width": "{{ '%999999999d'|format(1) }}",
    "replace growth": "{% set s = 'a' * 60000 %}{{ s.replace('a', s) }}",
    "replace filter growth": "{% set s = 'a' * 60000 %}{{ s|replace('a', s) }}",
    "join of a generator": "{{ range(60000)|map('string')|join('x' * 60000) }}",
    "indent growth": "{% set s = '\\n' * 60000 %}{{ s|indent(60000) }}",
    "huge int": "{{ 7 ** 100000000 }}",
    "output loop": "{% for i in range(60000) %}{% for j in range(60000) %}{{ 'xxxxxxxx' }}"
                   "{% endfor %}{% endfor %}",
    "recursive loop": "{% for x in [[1]] recursive %}{{ loop([x]) }}{% endfor %}",
    "exponential macro": "{% macro f(n) %}{% if n %}{{ f(n-1) }}{{ f(n-1) }}{% endif %}"
                         "{% endmacro %}{{ f(40) }}",
    "deep nesting": "{{ " + "(" * 5000 + "1" + ")" * 5000 + " }}",
    "quadratic regex filter": "{{ ('<' * 100000)|striptags }}",
    "wordwrap at width 1": "{{ ('a' * 1000000)|wordwrap(1) }}",
    "a long list built lazily": "{{ range(60000)|map('center', 60000)|list|length }}",
    "sum of lists": "{{ [[1]] * 50000|sum(start=[]) }}",
    "syntax error": "{% for %}",
    "a sandbox escape": "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "raise_exception": "{{ raise_exception('roles must alternate') }}",
    "undefined call": "{{ nothing() }}",
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_a_hostile_template_is_one_error_naming_the_file_within_seconds(meta, name):
    tok = _tokenizer(meta, HOSTILE[name])
    t0 = time.monotonic()
    with pytest.raises(ModelLoadError) as e:
        tok.apply_chat_template(MESSAGES)
    took = time.monotonic() - t0
    msg = str(e.value)
    assert msg.startswith("evil.gguf: its chat template failed: ") and "\n" not in msg, msg
    assert len(msg) < 400, msg
    # The time bound plus a margin for a loaded machine (the bound itself is
    # RENDER_SECONDS; the test asserts no hang, not a speed).
    assert took < chat_template.RENDER_SECONDS + 8, (name, took)


def test_a_long_template_source_is_refused(meta):
    with pytest.raises(ModelLoadError, match="more than"):
        _tokenizer(meta, "x" * (chat_template.SOURCE_LIMIT + 1)).apply_chat_template(MESSAGES)


# A template using what real chat templates use: namespace, loop variables, macros,
# tojson with an indent, filters (trim, selectattr, map, join, items, dictsort, length,
# default, replace, upper), methods (split, startswith, strip, format), slicing, ~, +, %,
# a recursive loop, {% filter %} and {% call %} blocks, raise_exception.
RICH = r"""
{%- macro render(m) -%}<{{ m.role|upper }}>{{ m.content|trim }}</{{ m.role }}>{%- endmacro -%}
{%- macro box(title) -%}[{{ title }}: {{ caller() }}]{%- endmacro -%}
{%- set ns = namespace(system='', n=0, seen=[]) -%}
{%- if messages[0]['role'] == 'system' -%}
  {%- set ns.system = messages[0]['content'] -%}{%- set loop_messages = messages[1:] -%}
{%- else -%}{%- set loop_messages = messages -%}{%- endif -%}
{{ bos_token }}{% if ns.system %}SYSTEM: {{ ns.system.strip() }}
{% endif %}
{%- for m in loop_messages -%}
  {%- if (m['role'] == 'user') != (loop.index0 % 2 == 0) -%}
    {{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
  {%- endif -%}
  {%- set ns.n = ns.n + m.content|length -%}
  {%- set ns.seen = ns.seen + [m.role] -%}
  {%- if m.role == 'assistant' and '</think>' in m.content -%}
    {{ render({'role': m.role, 'content': m.content.split('</think>')[-1]}) }}
  {%- else -%}{{ render(m) }}{%- endif -%}
  {%- if not loop.last %}{{ '\n' }}{% endif -%}
{%- endfor %}
{{ '{}|{}'.format(ns.n, ns.seen|join(',')) }} {{ '%d messages, %s' % (messages|length, 'ok') }}
{{ loop_messages|selectattr('role', 'equalto', 'user')|map(attribute='content')|join(' / ') }}
{{ {'b': 2, 'a': [1, 'é']}|tojson(indent=2) }} {{ {'b': 2, 'a': 1}|dictsort }}
{%- for k, v in {'x': 1}.items() %} {{ k ~ '=' ~ v }}{% endfor %}
{{ tools|default('no tools') }} {{ messages[-1].content[:5]|replace('a', 'A') }}
{%- for item in [1, [2, [3]]] recursive -%}
  {%- if item is iterable %}({{ loop(item) }}){% else %}{{ item }}{% endif -%}
{%- endfor %}
{% filter upper %}shout {{ eos_token }}{% endfilter %} {% call box('t') %}inner{% endcall %}
{%- if messages[0].content.startswith('You') %} formal{% endif %}
{%- if add_generation_prompt %}
<ASSISTANT>{% endif %}"""


def _plain_render(template, messages, **context):
    """The oracle: jinja2's own immutable sandbox with transformers' globals, unbounded."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])

    def raise_exception(message):
        raise jinja2.TemplateError(message)

    env.filters["tojson"] = lambda x, ensure_ascii=False, indent=None, separators=None, \
        sort_keys=False: json.dumps(x, ensure_ascii=ensure_ascii, indent=indent,
                                    separators=separators, sort_keys=sort_keys)
    env.globals.update(raise_exception=raise_exception,
                       strftime_now=lambda f: datetime.datetime.now().strftime(f))
    return env.from_string(template).render(messages=messages, **context)


CHATS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": " You are terse. "}, {"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "<think>easy</think>4"},
     {"role": "user", "content": "and a café ☕?"}],
    [{"role": "user", "content": "a" * 5000}, {"role": "assistant", "content": "b\n" * 300}],
]


@pytest.mark.parametrize("chat", range(len(CHATS)))
@pytest.mark.parametrize("generation", [True, False])
def test_a_well_behaved_template_renders_as_jinja2s_sandbox(chat, generation):
    context = dict(add_generation_prompt=generation, bos_token="<s>", eos_token="</s>")
    want = _plain_render(RICH, CHATS[chat], **context)
    got = chat_template.render(chat_template.compile_template(RICH), CHATS[chat], **context)
    assert got == want
    assert "Conversation roles" not in got and "1(2(3))" in got


def test_the_template_s_own_exception_is_reported(meta):
    tok = _tokenizer(meta, RICH)
    with pytest.raises(ModelLoadError, match="evil.gguf: its chat template failed: "
                                             "Conversation roles must alternate"):
        tok.apply_chat_template([{"role": "assistant", "content": "x"}])


def test_bounds_scale_with_the_messages(meta):
    """Output as long as the messages (times SIZE_PER_INPUT) is allowed past SIZE_BASE."""
    tok = _tokenizer(meta, "{% for m in messages %}{{ m.content }}{{ m.content }}{% endfor %}")
    text = "y" * (chat_template.SIZE_BASE + 10)
    assert tok.apply_chat_template([{"role": "user", "content": text}]) == text + text


@pytest.mark.slow
@pytest.mark.subprocess
def test_a_hostile_template_in_a_gguf_is_one_line_exit_2_within_seconds(tmp_path):
    """The real command line on a GGUF whose template loops for ever: one line naming
    the file, exit 2, no traceback, in seconds, before any weight is read."""
    path = rewrite_gguf(TINY_GGUF, tmp_path / "evil.gguf", set_kv={
        "tokenizer.chat_template": (HOSTILE["nested loops under the range cap"],
                                    gguf.GGUFValueType.STRING)})
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "jaxsample", "run", "--model", str(path), "--prompt",
                        "hi", "--chat", "--n", "2", "--max-new-tokens", "4"],
                       capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, JAX_PLATFORMS="cpu"))
    took = time.monotonic() - t0
    assert r.returncode == 2 and r.stdout == "", r.stderr
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.startswith(f"jaxsample: error: {path}: its chat template failed: it ran "
                               "longer than"), r.stderr
    assert took < 60, took


# ---------------------------------------------------------------------------
# Special token ids against the vocabulary


@pytest.mark.parametrize("key, value", [
    ("tokenizer.ggml.eos_token_id", 1_000_000), ("tokenizer.ggml.bos_token_id", 300),
    ("tokenizer.ggml.padding_token_id", 2**32 - 1), ("tokenizer.ggml.eot_token_id", 400),
    ("tokenizer.ggml.unknown_token_id", 5000)])
def test_a_special_token_id_outside_the_vocabulary_is_refused_naming_the_key(tmp_path, key,
                                                                             value):
    from jaxsample import loading

    path = rewrite_gguf(TINY_GGUF, tmp_path / "ids.gguf", set_kv={
        key: (value, gguf.GGUFValueType.UINT32)})
    for read in (loading.read_model, loading.load):
        with pytest.raises(ModelLoadError) as e:
            read(path, cache=False)
        assert str(e.value) == (f"{path}: {key} = {value} is not a token id of the 300-token "
                                "vocabulary"), str(e.value)


def test_special_ids_of_a_hugging_face_directory_are_checked(tmp_path):
    import shutil

    src = DATA / "tiny_qwen2"
    d = tmp_path / "model"
    shutil.copytree(src, d)
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 99999]}))
    with pytest.raises(ModelLoadError, match=r"generation_config.json: eos_token_id = 99999 is "
                                             r"not a token id of the \d+-token vocabulary"):
        CheckpointTokenizer.from_hf_dir(d)


def test_the_constructor_checks_its_ids(meta):
    tok = CheckpointTokenizer.from_gguf_metadata(meta, "ok.gguf")
    with pytest.raises(ModelLoadError, match="x: eos_token_ids = 300 is not a token id"):
        CheckpointTokenizer(tok.backend, bos_token_id=1, eos_token_ids=[2, 300], pad_token_id=None,
                            add_bos=False, chat_template=None, source="x")


# ---------------------------------------------------------------------------
# Lone surrogates


def test_encode_refuses_a_lone_surrogate_as_input(meta):
    tok = CheckpointTokenizer.from_gguf_metadata(meta, "ok.gguf")
    with pytest.raises(InputError, match=r"lone surrogate \('\\udfff' at character 3\)"):
        tok.encode("hi \udfff there")
    assert tok.encode("hi \U0001f642") == tok.encode("hi \ud83d\ude42".encode(
        "utf-16", "surrogatepass").decode("utf-16"))  # a paired surrogate is one character
