"""Incremental reasoning and tool-call parsers (see stream.py for the contract, formats.py for the formats)."""

from serve_app.parsers.answer import answer_required
from serve_app.parsers.formats import REASONING_PARSERS, TOOL_PARSERS, needs_special_tokens
from serve_app.parsers.stream import fold_complete, make_stream_parser, parse_complete

__all__ = ["REASONING_PARSERS", "TOOL_PARSERS", "answer_required", "fold_complete", "make_stream_parser",
           "needs_special_tokens", "parse_complete"]
