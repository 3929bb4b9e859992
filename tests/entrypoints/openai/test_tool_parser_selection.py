"""--tool-call-parser auto: the parser read off real chat templates (the hermes one kvserve
ships, the default model's tool-less chatml) and small ones in the style of each family's;
vLLM's explicit flags still win."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import kvserve
from kvserve.entrypoints.cli import build_parser
from kvserve.entrypoints.openai.tool_parsers.auto_select import (
    resolve_tool_parser,
    select_tool_parser,
    template_supports_tools,
)

HERMES = (
    Path(kvserve.__file__).parent / "entrypoints/chat_templates/tool_chat_template_hermes.jinja"
).read_text()
LLAMA_3_1 = """{%- if tools is not none %}{{- '<|start_header_id|>user<|end_header_id|>\\n\\n' }}
{{- 'Given the following functions, respond with a JSON for a function call with its proper '
'arguments. Respond in the format {"name": function name, "parameters": dictionary of '
'argument name and its value}.' }}{%- for t in tools %}{{- t | tojson }}{%- endfor %}{%- endif %}
{%- for message in messages %}{%- if 'tool_calls' in message %}{{- '<|python_tag|>' -}}
{%- elif message.role == 'tool' or message.role == 'ipython' %}
{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + message.content + '<|eot_id|>' }}
{%- endif %}{%- endfor %}"""
LLAMA_3_2_PYTHONIC = """{%- if tools %}{{- 'If you decide to invoke any of the function(s), you
MUST put it in the format of [func_name1(params_name1=params_value1, params_name2=params_value2...),
func_name2(params)]' }}{{- tools | tojson }}{%- endif %}{%- for message in messages %}
{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' + message.content }}
{%- endfor %}"""
MISTRAL = """{%- for message in messages %}{%- if message.role == 'user' %}{%- if tools and
loop.last %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{%- endif %}[INST]{{
message.content }}[/INST]{%- elif message.tool_calls %}[TOOL_CALLS]{{ message.tool_calls |
tojson }}</s>{%- elif message.role == 'tool' %}[TOOL_RESULTS]{{ message.content
}}[/TOOL_RESULTS]{%- endif %}{%- endfor %}"""
QWEN3_CODER = """{%- if tools %}{{- '<|im_start|>system\\n# Tools\\n\\n<tools>' }}{%- for tool
in tools %}{{- tool | tojson }}{%- endfor %}{{- '</tools>\\n\\nIf you choose to call a function
ONLY reply in the following format:\\n\\n<tool_call>\\n<function=example_function_name>\\n
<parameter=example_parameter_1>\\nvalue_1\\n</parameter>\\n</function>\\n</tool_call>' }}
{%- endif %}{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' +
message.content + '<|im_end|>\\n' }}{%- endfor %}"""
GRANITE = """{%- if tools %}{{- '<|start_of_role|>available_tools<|end_of_role|>' }}{{- tools
| tojson(indent=4) }}{{- '<|end_of_text|>\\n' }}{%- endif %}{%- for message in messages %}{%- if
message['role'] == 'assistant' and message.tool_calls %}{{- '<|start_of_role|>assistant<|end_of_
role|><|tool_call|>' + message.tool_calls | tojson }}{%- else %}{{- '<|start_of_role|>' +
message['role'] + '<|end_of_role|>' + message['content'] + '<|end_of_text|>\\n' }}{%- endif %}
{%- endfor %}"""
CHATML = """{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' +
message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{
'<|im_start|>assistant\\n' }}{% endif %}"""
GENERIC_TOOLS = "{{ tools | tojson }}{% for m in messages %}{{ m.content }}{% endfor %}"


@pytest.mark.parametrize(
    ("template", "parser"),
    [
        (HERMES, "hermes"),
        (LLAMA_3_1, "llama3_json"),
        (LLAMA_3_2_PYTHONIC, "pythonic"),
        (MISTRAL, "mistral"),
        (QWEN3_CODER, "qwen3_coder"),
        (GRANITE, "granite"),
        (GENERIC_TOOLS, "hermes"),
    ],
    ids=["hermes", "llama3.1", "llama3.2-pythonic", "mistral", "qwen3-coder", "granite", "other"],
)
def test_template_decides(template: str, parser: str) -> None:
    choice = select_tool_parser(template, vocab=())
    assert template_supports_tools(template)
    assert choice.name == parser and choice.reason


@pytest.mark.parametrize("template", [CHATML, None], ids=["chatml", "none"])
def test_a_template_without_tools_gets_the_hermes_fallback(template: str | None) -> None:
    assert not template_supports_tools(template)
    choice = select_tool_parser(template, vocab=())
    assert choice.name == "hermes" and "no tool support" in choice.reason


def test_the_default_models_template(tokenizer: Any) -> None:
    choice = resolve_tool_parser("auto", tokenizer.chat_template, tokenizer)
    assert not template_supports_tools(tokenizer.chat_template)
    assert choice.name == "hermes" and "no tool support" in choice.reason


def test_special_tokens_decide_where_the_template_does_not() -> None:
    assert select_tool_parser(GENERIC_TOOLS, vocab={"[TOOL_CALLS]": 5}).name == "mistral"
    assert select_tool_parser(GENERIC_TOOLS, vocab={"<|tool_call|>": 9}).name == "granite"
    # A template without tools renders the fallback whatever the vocabulary holds.
    assert select_tool_parser(CHATML, vocab={"[TOOL_CALLS]": 5}).name == "hermes"


@pytest.mark.parametrize(
    ("flags", "parser"),
    [
        ([], "hermes"),  # the default: auto, and the hermes template says hermes
        (["--enable-auto-tool-choice", "--tool-call-parser", "llama3_json"], "llama3_json"),
        (["--tool-call-parser", "pythonic"], "pythonic"),
    ],
)
def test_vllm_flags_override_the_selection(flags: list[str], parser: str) -> None:
    args = build_parser("serve").parse_args(["serve", *flags])
    choice = resolve_tool_parser(args.tool_call_parser, HERMES, None)
    assert choice.name == parser
