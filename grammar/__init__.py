"""prescient.grammar: grammar-constrained decoding on xgrammar (or llguidance: llg_backend.py).

Data flow for one constrained request:

    spec = spec_from_response_format(rf)  or  spec_from_tool_choice(tools_from_request(t), choice)
    pending = compiler.submit(spec)               # on arrival; compiles in the background
    matcher = pending.result().matcher()          # before the first constrained token
    per step: matcher.fill_bitmask(bitmask, row)  (or BatchMaskFiller.fill / tree_masks)
              matcher.accept_token(t) for committed tokens, matcher.rollback(n)
    output:   parse_tool_calls(text) or ToolCallStreamParser().feed(delta)

grammar/ imports nothing from prescient.runtime or prescient.speculative.
"""

from prescient.grammar.compiler import (
    CompiledGrammar,
    CompilerConfig,
    GrammarCompiler,
    PendingGrammar,
)
from prescient.grammar.errors import GrammarError
from prescient.grammar.formats import spec_from_response_format
from prescient.grammar.llg_backend import BACKENDS as GRAMMAR_BACKENDS
from prescient.grammar.llg_backend import llguidance_available
from prescient.grammar.matcher import BatchMaskFiller, Matcher, allocate_bitmask
from prescient.grammar.pattern import check_pattern
from prescient.grammar.schema.check import check_schema
from prescient.grammar.spec import GrammarSpec
from prescient.grammar.tokenizer import GrammarTokenizer
from prescient.grammar.tool_parser import (
    ContentDelta,
    ParsedOutput,
    StreamEvent,
    ToolCall,
    ToolCallArgumentsDelta,
    ToolCallEnd,
    ToolCallStart,
    ToolCallStreamParser,
    parse_tool_calls,
)
from prescient.grammar.tools import ToolSpec, call_header, spec_from_tool_choice, tools_from_request
from prescient.grammar.tree import TreeMasks, prune_tree, tree_masks

__all__ = [
    "BatchMaskFiller",
    "CompiledGrammar",
    "CompilerConfig",
    "ContentDelta",
    "GrammarCompiler",
    "GRAMMAR_BACKENDS",
    "GrammarError",
    "GrammarSpec",
    "GrammarTokenizer",
    "Matcher",
    "ParsedOutput",
    "PendingGrammar",
    "StreamEvent",
    "ToolCall",
    "ToolCallArgumentsDelta",
    "ToolCallEnd",
    "ToolCallStart",
    "ToolCallStreamParser",
    "ToolSpec",
    "TreeMasks",
    "allocate_bitmask",
    "call_header",
    "check_pattern",
    "check_schema",
    "llguidance_available",
    "parse_tool_calls",
    "prune_tree",
    "spec_from_response_format",
    "spec_from_tool_choice",
    "tools_from_request",
    "tree_masks",
]
