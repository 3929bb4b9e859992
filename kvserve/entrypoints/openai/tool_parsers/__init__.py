"""Tool call parsers, chosen by ``--tool-call-parser``; importing the package registers the
built-in ones (hermes, llama3_json, mistral, pythonic, qwen3_coder, granite)."""

from kvserve.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    ExtractedToolCallInformation,
    ToolCallStreamer,
    ToolParser,
    ToolParserManager,
)
from kvserve.entrypoints.openai.tool_parsers.granite_tool_parser import GraniteToolParser
from kvserve.entrypoints.openai.tool_parsers.hermes_tool_parser import Hermes2ProToolParser
from kvserve.entrypoints.openai.tool_parsers.llama_tool_parser import Llama3JsonToolParser
from kvserve.entrypoints.openai.tool_parsers.mistral_tool_parser import MistralToolParser
from kvserve.entrypoints.openai.tool_parsers.pythonic_tool_parser import PythonicToolParser
from kvserve.entrypoints.openai.tool_parsers.qwen3coder_tool_parser import Qwen3CoderToolParser

__all__ = [
    "ExtractedToolCallInformation",
    "GraniteToolParser",
    "Hermes2ProToolParser",
    "Llama3JsonToolParser",
    "MistralToolParser",
    "PythonicToolParser",
    "Qwen3CoderToolParser",
    "ToolCallStreamer",
    "ToolParser",
    "ToolParserManager",
]
