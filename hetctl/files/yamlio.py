"""Load and save the YAML files that pass between commands.

Every file is validated against its pydantic model on load. A validation error
becomes one :class:`~hetctl.errors.ConfigError` line naming the file, the line
and the key path (``inventory.yaml:12: nodes[2].port: …``).

The files are read as hostile input: anything a user (or an attacker who can
write the file) puts there ends as a valid load or as that one line, never as a
traceback, a hang or a blow-up of memory. So, before any value is built:

* the bytes must be UTF-8 and at most :data:`MAX_FILE_BYTES`;
* anchors, aliases and merge keys (``&a``, ``*a``, ``<<: *a``) are accepted, so a
  hand-written file can share a chip list between nodes, but their expansion is
  bounded: an alias bomb (a "billion laughs") would expand exponentially in
  whatever walks the data, so a file whose aliases expand past
  :data:`MAX_EXPANDED_NODES` YAML nodes (or :data:`MAX_DEPTH` levels), or refer
  to themselves, is refused from the node graph, before any value is built;
* explicit tags (``!!int``, ``!!python/…``) are refused, and dates stay strings;
* nesting deeper than :data:`MAX_DEPTH` is refused (libyaml's composer recurses
  in C and would crash the interpreter on a deep enough file).

A model may define ``check_consistency()``, raising :class:`Invalid` with a key
path, for rules that span fields (layer ranges, rank tables); :func:`load_model`
calls it after validation so every file of that kind is checked on load.
"""

from __future__ import annotations

import difflib
import json
import typing
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from hetctl.errors import ConfigError
from hetctl.files.fields import Invalid
from hetctl.node.runtime import write_atomic

M = TypeVar("M", bound=BaseModel)

MAX_FILE_BYTES = 256 << 20  # a 100,000-node cluster file is about 120 MB
MAX_DEPTH = 64  # hetctl's own files nest 5 deep
# What aliases may expand a file to, in YAML nodes (a 1,000-node cluster of 8 chips each is about 150,000).
MAX_EXPANDED_NODES = 4_000_000

# libyaml's parser when PyYAML was built with it: ten times faster on a 4096-node cluster file.
_BaseLoader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class _Loader(_BaseLoader):  # type: ignore[misc, valid-type]
    """The safe loader without implicit timestamps: ``2020-13-01`` is a string, not a crash in datetime."""

    yaml_implicit_resolvers = {
        first: [(tag, rx) for tag, rx in entries if tag != "tag:yaml.org,2002:timestamp"]
        for first, entries in _BaseLoader.yaml_implicit_resolvers.items()
    }


class _At(Exception):
    """A problem at a YAML mark (0-based line), before any value exists."""

    def __init__(self, line: int | None, msg: str, hint: str | None = None) -> None:
        super().__init__(msg)
        self.line, self.msg, self.hint = line, msg, hint


def one_line(text: str) -> str:
    """``text`` with every line break and control character escaped, so an error stays one line."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text)


def located_error(path: str | Path, line: int | None, key: str | None, msg: str,
                  hint: str | None = None) -> ConfigError:
    """``FILE:LINE: KEY: MSG`` as one line (line and key left out where unknown)."""
    where = f"{path}:{line}" if line else str(path)
    text = f"{where}: {key}: {msg}" if key else f"{where}: {msg}"
    return ConfigError(one_line(text), one_line(hint) if hint else None)


def _refuse_duplicate_keys(node: yaml.Node | None) -> None:
    """Raise _At for a mapping that repeats a key (YAML would keep the last silently).

    A node that aliases share is checked once (the graph, not its expansion).
    """
    stack = [node] if node is not None else []
    seen_nodes: set[int] = set()
    while stack:
        n = stack.pop()
        if id(n) in seen_nodes:
            continue
        seen_nodes.add(id(n))
        if isinstance(n, yaml.MappingNode):
            seen: set[str] = set()
            for k, v in n.value:
                if isinstance(k, yaml.ScalarNode):
                    if k.value in seen:
                        raise _At(k.start_mark.line, f"duplicate key {k.value!r}", "remove one of the two entries")
                    seen.add(k.value)
                stack.append(v)
        elif isinstance(n, yaml.SequenceNode):
            stack.extend(n.value)


def _has_aliases(text: str) -> bool:
    """Whether the document may use aliases (``*name``): only then can it expand beyond its written size."""
    return "*" in text


def _check_events(text: str) -> None:
    """Refuse explicit tags and deep nesting, from the event stream (nothing is built)."""
    loader = _Loader(text)
    depth = 0
    try:
        while loader.check_event():
            ev = loader.get_event()
            line = ev.start_mark.line if ev.start_mark is not None else None
            if getattr(ev, "tag", None) is not None:
                raise _At(line, f"YAML tag {ev.tag!r} is not accepted", "write the plain value, quoted if it is text")
            if isinstance(ev, yaml.CollectionStartEvent):
                depth += 1
                if depth > MAX_DEPTH:
                    raise _At(line, f"nested more than {MAX_DEPTH} levels deep", "hetctl's files nest a few levels")
            elif isinstance(ev, yaml.CollectionEndEvent):
                depth -= 1
    finally:
        loader.dispose()


def _children(n: yaml.Node) -> list[yaml.Node]:
    if isinstance(n, yaml.MappingNode):
        return [x for kv in n.value for x in kv]
    return list(n.value) if isinstance(n, yaml.SequenceNode) else []


def _bound_expansion(root: yaml.Node) -> None:
    """Raise _At when aliases make the document larger than :data:`MAX_EXPANDED_NODES`, deeper than
    :data:`MAX_DEPTH`, or recursive. Each shared node is measured once, so a bomb costs its written size."""
    sizes: dict[int, tuple[int, int]] = {}  # id(node) -> (expanded nodes, height)
    open_: set[int] = set()

    def measure(n: yaml.Node, level: int) -> tuple[int, int]:
        key = id(n)
        if level > MAX_DEPTH:
            raise _At(n.start_mark.line, f"nested more than {MAX_DEPTH} levels deep once aliases are expanded",
                      "hetctl's files nest a few levels")
        if key in sizes:
            size, height = sizes[key]
        else:
            if key in open_:
                raise _At(n.start_mark.line, "a YAML alias refers to a node that contains it",
                          "an anchor cannot hold an alias of itself")
            open_.add(key)
            size, height = 1, 0
            for child in _children(n):
                s, h = measure(child, level + 1)
                size, height = size + s, max(height, h + 1)
            open_.discard(key)
            sizes[key] = (size, height)
        if size > MAX_EXPANDED_NODES:
            raise _At(n.start_mark.line, f"YAML aliases expand this to more than {MAX_EXPANDED_NODES:,} values",
                      "write the file without nested aliases (a chip entry's count: repeats it)")
        if level + height > MAX_DEPTH:
            raise _At(n.start_mark.line, f"nested more than {MAX_DEPTH} levels deep once aliases are expanded",
                      "hetctl's files nest a few levels")
        return size, height

    measure(root, 0)


def _first_bad_scalar(root: yaml.Node) -> int | None:
    """The 0-based line of the first scalar that cannot be built (error path only)."""
    loader = _Loader("")
    stack = [root]
    while stack:
        n = stack.pop(0)
        if isinstance(n, yaml.ScalarNode):
            try:
                loader.construct_object(n)
            except (ValueError, OverflowError, yaml.YAMLError):
                return n.start_mark.line
        elif isinstance(n, yaml.MappingNode):
            stack[:0] = [x for kv in n.value for x in kv]
        elif isinstance(n, yaml.SequenceNode):
            stack[:0] = list(n.value)
    return None


def _compose_and_build(text: str) -> tuple[Any, yaml.Node | None]:
    """One parse: the node tree (for line numbers and duplicate keys), then the data built from it."""
    loader = _Loader(text)
    try:
        root = loader.get_single_node()
        if root is None:
            return None, None
        if _has_aliases(text):
            _bound_expansion(root)
        _refuse_duplicate_keys(root)
        try:
            return loader.construct_document(root), root
        except (ValueError, OverflowError) as e:  # an int past Python's 4300-digit limit, say
            # Python's own message goes on to suggest sys.set_int_max_str_digits(); keep only the fact.
            raise _At(_first_bad_scalar(root), f"a value cannot be read: {str(e).split(';')[0]}") from None
    finally:
        loader.dispose()


def _decode(p: Path, raw: bytes) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise located_error(p, line, None, f"not UTF-8 text (byte 0x{raw[e.start]:02x})",
                            "save the file as UTF-8") from None


def _yaml_error(p: Path, text: str, e: yaml.YAMLError) -> ConfigError:
    if isinstance(e, yaml.reader.ReaderError):
        # libyaml counts UTF-8 bytes, PyYAML's own reader characters.
        prefix = text.encode()[: e.position] if _BaseLoader is not yaml.SafeLoader else text[: e.position]
        line = prefix.count(b"\n" if isinstance(prefix, bytes) else "\n") + 1
        char = e.character if isinstance(e.character, int) else ord(e.character or "\0")
        return located_error(p, line, None, f"not valid YAML: character #x{char:04x} is not allowed",
                             "remove control characters from the file")
    mark = getattr(e, "problem_mark", None)
    problem = getattr(e, "problem", None) or str(e)
    return located_error(p, mark.line + 1 if mark else None, None, f"not valid YAML: {problem}", "fix the syntax")


def format_loc(loc: tuple[Any, ...]) -> str:
    """Render a pydantic location tuple as ``nodes[2].port`` (odd keys quoted: ``env['A B']``)."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part == "[key]":  # pydantic's marker for a dict key that failed
            out += " (the key)"
        elif isinstance(part, str) and part.replace("_", "a").replace("-", "a").isalnum() and part.isascii():
            out += ("." if out else "") + part
        else:
            out += f"[{one_line(repr(part))}]"
    return out or "(top level)"


def _line_of(root: yaml.Node | None, loc: tuple[Any, ...]) -> int | None:
    """Best-effort 1-based line of the YAML node at ``loc``."""
    node = root
    line = node.start_mark.line + 1 if node is not None else None
    for part in loc:
        if isinstance(node, yaml.MappingNode):
            nxt = None
            for k, v in node.value:
                if getattr(k, "value", None) == str(part):
                    nxt, line = v, k.start_mark.line + 1
                    break
            node = nxt
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and 0 <= part < len(node.value):
            node = node.value[part]
            line = node.start_mark.line + 1
        else:
            break
        if node is None:
            break
    return line


def read_yaml(path: str | Path, what: str = "file") -> tuple[Any, yaml.Node | None]:
    """Parse a YAML file, returning the data and its node tree (for line numbers).

    Raises:
        ConfigError: missing, unreadable, too big, not UTF-8, not YAML, or using
            tags, deep nesting or aliases that expand too far (see the module docstring).
    """
    p = Path(path)
    try:
        with open(p, "rb") as f:
            raw = f.read(MAX_FILE_BYTES + 1)
    except FileNotFoundError:
        raise located_error(p, None, None, f"{what} not found", "check the path") from None
    except OSError as e:
        raise located_error(p, None, None, f"cannot read {what}: {e.strerror or e}") from None
    if len(raw) > MAX_FILE_BYTES:
        raise located_error(p, None, None, f"{what} is larger than {MAX_FILE_BYTES >> 20} MiB")
    text = _decode(p, raw)
    try:
        _check_events(text)
        return _compose_and_build(text)
    except _At as e:
        raise located_error(p, e.line + 1 if e.line is not None else None, None, e.msg, e.hint) from None
    except yaml.YAMLError as e:
        raise _yaml_error(p, text, e) from None


def _unwrap(tp: Any) -> list[Any]:
    """The concrete types inside ``Annotated``/``Optional``/unions."""
    origin = typing.get_origin(tp)
    if origin is typing.Annotated:
        return _unwrap(typing.get_args(tp)[0])
    if origin is typing.Union or type(tp).__name__ == "UnionType":
        return [t for a in typing.get_args(tp) for t in _unwrap(a)]
    return [tp]


def known_keys(model: Any, loc: tuple[Any, ...]) -> list[str]:
    """The keys a mapping at ``loc`` may hold under ``model`` (``[]`` when it cannot tell)."""
    current = [model]
    for part in loc:
        nxt = []
        for tp in (t for c in current for t in _unwrap(c)):
            origin, args = typing.get_origin(tp), typing.get_args(tp)
            if isinstance(tp, type) and issubclass(tp, BaseModel) and isinstance(part, str):
                field = tp.model_fields.get(part)
                nxt += [field.annotation] if field is not None else []
            elif origin in (list, tuple) and isinstance(part, int) and args:
                nxt.append(args[0])
            elif origin is dict and len(args) == 2:
                nxt.append(args[1])
        current = nxt
    keys = [k for c in current for t in _unwrap(c) if isinstance(t, type) and issubclass(t, BaseModel)
            for k in t.model_fields]
    return list(dict.fromkeys(keys))


def validation_error(path: str | Path, err: ValidationError, root: yaml.Node | None = None,
                     model: Any = None) -> ConfigError:
    """Turn pydantic's errors into one ConfigError line naming file, line and key.

    An unknown key is reported first, with the closest known key when ``model``
    is given (``hots: unknown key, did you mean host?``); a required key that
    the misspelling explains is not counted again.
    """
    errors = err.errors()
    errors.sort(key=lambda e: e.get("type") != "extra_forbidden")  # stable: file order otherwise
    first = errors[0]
    loc = tuple(first.get("loc", ()))
    line = _line_of(root, loc) if root is not None else None
    msg = first.get("msg", "invalid value")
    explained: tuple[Any, ...] | None = None
    if first.get("type") == "extra_forbidden":
        msg, hint = "unknown key", "check the spelling against the file format in docs/"
        close = difflib.get_close_matches(str(loc[-1]), known_keys(model, loc[:-1]), n=1) if model and loc else []
        if close:
            msg += f", did you mean {close[0]}?"
            explained = (*loc[:-1], close[0])
    elif first.get("type") == "missing":
        msg, hint = "required key is missing", "add it"
    else:
        msg, hint = msg.removeprefix("Value error, "), None
    more = sum(1 for e in errors[1:] if not (e.get("type") == "missing" and tuple(e.get("loc", ())) == explained))
    suffix = f" (and {more} more problem{'s' if more > 1 else ''})" if more else ""
    return located_error(path, line, format_loc(loc), f"{msg}{suffix}", hint)


def load_model(path: str | Path, model: type[M], what: str = "file") -> M:
    """Read ``path`` and validate it as ``model``; errors name file, line and key.

    When the model defines ``prepare_input(data)`` (hand-written shorthand
    expanded before validation) or ``check_consistency()`` they run too; an
    :class:`Invalid` either raises becomes the same one-line ConfigError.
    """
    data, root = read_yaml(path, what)
    if data is None:
        raise located_error(path, None, None, f"{what} is empty")
    expected = getattr(model, "FILE_KIND", None)
    if expected is not None:
        from hetctl.files.kinds import check_kind

        check_kind(path, data, expected)
    prepare = getattr(model, "prepare_input", None)
    if prepare is not None:
        try:
            data = prepare(data)
        except Invalid as e:
            raise located_error(path, _line_of(root, e.loc), format_loc(e.loc), e.msg, e.hint) from None
    try:
        obj = model.model_validate(data)
    except ValidationError as e:
        raise validation_error(path, e, root, model) from None
    check = getattr(obj, "check_consistency", None)
    if check is not None:
        try:
            check()
        except Invalid as e:
            raise located_error(path, _line_of(root, e.loc), format_loc(e.loc), e.msg, e.hint) from None
    return obj


def dump_yaml(data: Any) -> str:
    """YAML text with keys in insertion order, no aliases."""

    # libyaml's emitter where PyYAML has it: the same text, three times faster (a plan of 8,192 ranks, written at
    # every attempt, took 3.1 s in pure Python; bench/scale.py).
    class _NoAlias(getattr(yaml, "CSafeDumper", yaml.SafeDumper)):
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
    write_atomic(p, text.encode())
    return p


def to_json(obj: BaseModel | Any) -> str:
    """JSON for ``--json`` on stdout."""
    if isinstance(obj, BaseModel):
        return obj.model_dump_json(indent=2)
    return json.dumps(obj, indent=2, default=str)


def written_by(path: str | Path, words: str, head_bytes: int = 400) -> bool:
    """Whether the file at ``path`` (not a link) says ``words`` in its first lines: one of hetctl's own files.

    Used before replacing a file hetctl writes (a demo inventory, a node script) so a
    user's own file of the same name is never overwritten.
    """
    p = Path(path)
    try:
        with open(p, encoding="utf-8", errors="replace") as f:
            head = f.read(head_bytes)
    except OSError:
        return False
    return not p.is_symlink() and words in head
