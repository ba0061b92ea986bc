"""YAML as kvscope reads its input files (the matrix, scenarios): safe types only, every key once (a merge key
`<<` too), and no alias that multiplies the document (an alias bomb of a kilobyte grows tenfold per level of
aliases, in nodes or in the bytes of its scalars)."""

from __future__ import annotations

from typing import Any

import yaml

MAX_NODES = 100_000  # nodes of a document with its aliases expanded; the shipped matrix has about 700
MAX_BYTES = 8 * 2**20  # its scalars' characters with its aliases expanded; the shipped matrix has about 14 000
MERGE = "tag:yaml.org,2002:merge"


class _Loader(yaml.SafeLoader):
    def construct_mapping(self, node, deep=False):
        seen = set()
        for key, _ in node.value:
            if isinstance(key, yaml.ScalarNode) and key.tag != MERGE:
                if (key.tag, key.value) in seen:
                    raise yaml.constructor.ConstructorError(None, None, f"key '{key.value}' is given twice",
                                                            key.start_mark)
                seen.add((key.tag, key.value))
        return super().construct_mapping(node, deep)


def _expanded(node: yaml.Node, sizes: dict[int, tuple[int, int]], open_: set[int]) -> tuple[int, int]:
    """How many nodes `node` holds, and how many characters its scalars, with every alias expanded (an alias is
    the node it names, shared); refuses a mapping with two merge keys (the second would replace the first's
    keys silently)."""
    if id(node) in sizes:
        return sizes[id(node)]
    if id(node) in open_:
        raise yaml.composer.ComposerError(None, None, "an alias that holds itself", node.start_mark)
    open_.add(id(node))
    if isinstance(node, yaml.MappingNode) and sum(key.tag == MERGE for key, _ in node.value) > 1:
        raise yaml.constructor.ConstructorError(None, None, "a mapping gives the merge key '<<' twice",
                                                node.start_mark)
    children = node.value if isinstance(node, yaml.SequenceNode) else (
        [n for pair in node.value for n in pair] if isinstance(node, yaml.MappingNode) else [])
    counts = [_expanded(child, sizes, open_) for child in children]
    own = len(node.value) if isinstance(node, yaml.ScalarNode) else 0
    sizes[id(node)] = (1 + sum(n for n, _ in counts), own + sum(b for _, b in counts))
    open_.discard(id(node))
    return sizes[id(node)]


def load(text: str) -> Any:
    """The document in `text`; raises yaml.YAMLError on anything refused, with where it is."""
    loader = _Loader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        nodes, chars = _expanded(node, {}, set())
        if nodes > MAX_NODES:
            raise yaml.YAMLError(f"its aliases expand it to {nodes} nodes (at most {MAX_NODES})")
        if chars > MAX_BYTES:
            raise yaml.YAMLError(f"its aliases expand it to {chars} bytes of text (at most {MAX_BYTES})")
        return loader.construct_document(node)
    except RecursionError as exc:
        raise yaml.YAMLError("nested too deeply") from exc
    finally:
        loader.dispose()
