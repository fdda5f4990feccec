"""Safe YAML loading that rejects duplicate keys, with the file and line in the message."""

from __future__ import annotations

from typing import Any

import yaml

from coordinated_prep.errors import ConfigError


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml.SafeLoader (no arbitrary objects) that refuses a mapping with the same key twice."""


def _construct_mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise ConfigError(
                f"line {key_node.start_mark.line + 1}: duplicate key {key!r} (first at line {seen[key]}); "
                "keep one of them"
            )
        seen[key] = key_node.start_mark.line + 1
    return loader.construct_mapping(node, deep=deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def load_yaml(path: str) -> Any:
    """Parse ``path`` with a safe loader; errors name the file (and line) and what to fix."""
    try:
        with open(path, encoding="utf-8") as f:
            return yaml.load(f, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such experiment file") from None
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
