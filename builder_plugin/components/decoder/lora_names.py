"""The names of the decoder's LoRA nodes: one format, written by the GenAI builder subclass (`genai_builder`), and
one parser, with which the routing pass (`mode_routing`) finds the branches again.

A projection ``{site}`` (the GenAI builder's node path, e.g. ``/model/layers.0/attn/q_proj``) with an adapter gets
``{owner}/lora_A.{adapter}/MatMul`` (one per source projection: packed qkv and gate_up share theirs, so ``owner`` is
that source), ``{site}/lora_B.{adapter}/MatMul`` and ``{site}/lora.{adapter}/Add``. The quantizer renames a MatMul it
rewrites to ``.../MatMul_Q4`` (and so on), which the parser accepts.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

Part = Literal["A", "B", "Add"]

_NODE = re.compile(r"^(?P<site>.*)/lora(?:_(?P<matrix>[AB]))?\.(?P<adapter>\w+)/(?P<op>MatMul(?:_Q\w+)?|Add)$")


def lora_node(site: str, adapter: str, part: Part) -> str:
    """The node name of one part of an adapter's branch at `site` (for "A": the owner projection)."""
    if part == "Add":
        return f"{site}/lora.{adapter}/Add"
    return f"{site}/lora_{part}.{adapter}/MatMul"


@dataclass(frozen=True)
class LoraNode:
    site: str  # the projection (for "A": its owner)
    adapter: str
    part: Part


def parse_lora_node(name: str | None) -> LoraNode | None:
    """The LoRA part a node name is, or None for any other node."""
    match = _NODE.match(name or "")
    if match is None:
        return None
    matrix, is_add = match["matrix"], match["op"] == "Add"
    if (matrix is None) != is_add:  # "lora_A.x/Add" or "lora.x/MatMul": not ours
        return None
    return LoraNode(match["site"], match["adapter"], "Add" if is_add else matrix)


def weight_name(node_name: str) -> str:
    """The initializer name of a MatMul's weight, as the GenAI builder derives it from the node name."""
    return node_name[1:].replace("/", ".") + ".weight"
