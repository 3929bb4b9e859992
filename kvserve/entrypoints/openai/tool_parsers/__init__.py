"""Tool call parsers, chosen by ``--tool-call-parser``; importing the package registers the
built-in ones (hermes, llama3_json)."""

from kvserve.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    ExtractedToolCallInformation,
    ToolCallStreamer,
    ToolParser,
    ToolParserManager,
)
from kvserve.entrypoints.openai.tool_parsers.hermes_tool_parser import Hermes2ProToolParser
from kvserve.entrypoints.openai.tool_parsers.llama_tool_parser import Llama3JsonToolParser

__all__ = [
    "ExtractedToolCallInformation",
    "Hermes2ProToolParser",
    "Llama3JsonToolParser",
    "ToolCallStreamer",
    "ToolParser",
    "ToolParserManager",
]
