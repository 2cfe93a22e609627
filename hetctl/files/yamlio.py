"""Load and save the YAML files that pass between commands.

Every file is validated against its pydantic model on load. A validation error
becomes one :class:`~hetctl.errors.ConfigError` line naming the file, the line
and the key path (``inventory.yaml:12: nodes[2].port: …``).
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from hetctl.errors import ConfigError

M = TypeVar("M", bound=BaseModel)


# libyaml's parser when PyYAML was built with it: ten times faster on a 4096-node cluster file.
_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def _refuse_duplicate_keys(node: yaml.Node | None) -> None:
    """Raise ConfigError for a mapping that repeats a key (YAML would keep the last silently)."""
    stack = [node] if node is not None else []
    while stack:
        n = stack.pop()
        if isinstance(n, yaml.MappingNode):
            seen: set[str] = set()
            for k, v in n.value:
                if isinstance(k, yaml.ScalarNode):
                    if k.value in seen:
                        raise ConfigError(
                            f"{k.start_mark.line + 1}: duplicate key {k.value!r}",
                            "remove one of the two entries",
                        )
                    seen.add(k.value)
                stack.append(v)
        elif isinstance(n, yaml.SequenceNode):
            stack.extend(n.value)


def format_loc(loc: tuple[Any, ...]) -> str:
    """Render a pydantic location tuple as ``nodes[2].port``."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out or "(top level)"


def _line_of(root: yaml.Node | None, loc: tuple[Any, ...]) -> int | None:
    """Best-effort 1-based line of the YAML node at ``loc``."""
    node = root
    line = node.start_mark.line + 1 if node is not None else None
    for part in loc:
        if isinstance(node, yaml.MappingNode):
            nxt = None
            for k, v in node.value:
                if k.value == str(part):
                    nxt, line = v, k.start_mark.line + 1
                    break
            node = nxt
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part < len(node.value):
            node = node.value[part]
            line = node.start_mark.line + 1
        else:
            break
        if node is None:
            break
    return line


def read_yaml(path: str | Path, what: str = "file") -> tuple[Any, yaml.Node | None]:
    """Parse a YAML file, returning the data and its node tree (for line numbers)."""
    p = Path(path)
    try:
        text = p.read_text()
    except FileNotFoundError:
        raise ConfigError(f"{p}: {what} not found", "check the path") from None
    except OSError as e:
        raise ConfigError(f"{p}: cannot read {what}: {e.strerror}") from None
    try:
        root = yaml.compose(text, Loader=_Loader)
        _refuse_duplicate_keys(root)
        data = yaml.load(text, Loader=_Loader)  # noqa: S506 - a safe loader
    except ConfigError as e:
        raise ConfigError(f"{p}:{e.message}", e.hint) from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f":{mark.line + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e)
        raise ConfigError(f"{p}{where}: not valid YAML: {problem}", "fix the syntax") from None
    return data, root


def validation_error(path: str | Path, err: ValidationError, root: yaml.Node | None = None) -> ConfigError:
    """Turn the first pydantic error into a one-line ConfigError naming file, line and key."""
    first = err.errors()[0]
    loc = tuple(first.get("loc", ()))
    line = _line_of(root, loc) if root is not None else None
    where = f"{path}:{line}" if line else str(path)
    msg = first.get("msg", "invalid value")
    if first.get("type") == "extra_forbidden":
        msg = "unknown key"
        hint = "check the spelling against the README's file format"
    elif first.get("type") == "missing":
        msg = "required key is missing"
        hint = "add it"
    else:
        hint = None
    more = len(err.errors()) - 1
    suffix = f" (and {more} more problem{'s' if more > 1 else ''})" if more else ""
    return ConfigError(f"{where}: {format_loc(loc)}: {msg}{suffix}", hint)


def load_model(path: str | Path, model: type[M], what: str = "file") -> M:
    """Read ``path`` and validate it as ``model``; errors name file, line and key."""
    data, root = read_yaml(path, what)
    if data is None:
        raise ConfigError(f"{path}: {what} is empty")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise validation_error(path, e, root) from None


def dump_yaml(data: Any) -> str:
    """YAML text with keys in insertion order, no aliases."""

    class _NoAlias(yaml.SafeDumper):
        def ignore_aliases(self, data):
            return True

    return yaml.dump(data, Dumper=_NoAlias, sort_keys=False, default_flow_style=None, width=100)


def save_model(path: str | Path, obj: BaseModel, header: str | None = None) -> Path:
    """Write ``obj`` as YAML atomically (temp file, then rename)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    text = dump_yaml(obj.model_dump(mode="json"))
    if header:
        text = "".join(f"# {line}\n" for line in header.splitlines()) + text
    fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=f".{p.name}.")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, p)
    return p


def to_json(obj: BaseModel | Any) -> str:
    """JSON for ``--json`` on stdout."""
    if isinstance(obj, BaseModel):
        return obj.model_dump_json(indent=2)
    return json.dumps(obj, indent=2, default=str)
