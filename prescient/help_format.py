"""The help formatter of every prescient command line: each option shows its default, except
where there is none to show (None, False, a suppressed value) and the help text says what
unset means. A leaf module (argparse only), shared by the CLI and latency_bench."""

from __future__ import annotations

import argparse


class DefaultsHelpFormatter(argparse.HelpFormatter):
    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if ("%(default)" in text or action.default is None or action.default is False
                or action.default == argparse.SUPPRESS or not action.option_strings):
            return text
        return f"{text} (default: %(default)s)"
