"""Safe YAML loading that rejects duplicate keys, with the file and line in the message.

Numbers are read as YAML 1.2 reads them, as in Python and JSON. PyYAML follows YAML 1.1, where
``1e-3`` (an exponent without a dot), ``-.5`` and ``.5e3`` are strings, ``017`` is octal (15), ``08`` a
string and ``1:30`` a number in base 60 (90); here they are 0.001, -0.5, 500.0, 17, 8 and the string.
"""

from __future__ import annotations

import re
from typing import Any

import yaml

from coordinated_prep.errors import ConfigError


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml.SafeLoader (no arbitrary objects) that refuses a mapping with the same key twice."""


# Its own copy of the resolvers (adding to SafeLoader's would change every other user's yaml.safe_load).
_UniqueKeyLoader.yaml_implicit_resolvers = {k: list(v) for k, v in yaml.SafeLoader.yaml_implicit_resolvers.items()}
_INT = "tag:yaml.org,2002:int"
for _first, _resolvers in _UniqueKeyLoader.yaml_implicit_resolvers.items():  # YAML 1.1's ints out
    _resolvers[:] = [(tag, regexp) for tag, regexp in _resolvers if tag != _INT]
_UniqueKeyLoader.add_implicit_resolver(
    _INT, re.compile(r"^(?:[-+]?[0-9][0-9_]*|[-+]?0o[0-7_]+|[-+]?0x[0-9a-fA-F_]+)$"), list("-+0123456789"))
_UniqueKeyLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^(?:[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+"
                                          r"|[-+]?\.[0-9_]+(?:[eE][-+]?[0-9]+)?)$"), list("-+.0123456789"))


def _construct_int(loader: _UniqueKeyLoader, node: yaml.ScalarNode) -> int:
    """Decimal whatever its leading zeros (``017`` is 17), ``0o`` octal, ``0x`` hexadecimal."""
    text = str(loader.construct_scalar(node)).replace("_", "")
    sign, digits = (-1, text[1:]) if text[:1] == "-" else (1, text.lstrip("+"))
    base = {"0o": 8, "0x": 16}.get(digits[:2].lower(), 10)
    return sign * int(digits[2:] if base != 10 else digits, base)


_UniqueKeyLoader.add_constructor(_INT, _construct_int)

_MERGE = "tag:yaml.org,2002:merge"


def _construct_mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        if key_node.tag == _MERGE:  # `<<: *base`: merged by construct_mapping below
            continue
        key = loader.construct_object(key_node, deep=deep)
        try:
            hash(key)
        except TypeError:
            raise ConfigError(f"line {key_node.start_mark.line + 1}: a {type(key).__name__} cannot be a key; use a name") from None
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
    except (OSError, UnicodeDecodeError) as e:  # a directory, no permission, not UTF-8 text
        raise ConfigError(f"{path}: cannot be read as an experiment file ({e}); give a YAML file") from None
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
