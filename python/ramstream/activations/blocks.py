"""Re-exports, for existing callers: the block-stack helpers live in the leaf ramstream/blocks.py
and the option parser parse_block_choice in ramstream/options.py (both import nothing from the
package, so that planner/, quant/, weights/ and options.py do not import each other through here)."""

from __future__ import annotations

from ..blocks import chosen_blocks, find_blocks, fraction_to_blocks, ranges_text
from ..options import parse_block_choice

__all__ = ["chosen_blocks", "find_blocks", "fraction_to_blocks", "parse_block_choice", "ranges_text"]
