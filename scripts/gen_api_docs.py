"""Writes docs/API.md, the Python API reference, from the public docstrings:
every name in ``pyfa.__all__`` and the public modules below, with its
signature. A public function, class, method or property without a docstring
is an error, and so is a name in ``pyfa.__all__`` that this script cannot
place.

    python3 scripts/gen_api_docs.py           # rewrite docs/API.md
    python3 scripts/gen_api_docs.py --check   # exit 1 if docs/API.md is stale

``tests/test_api_docs.py`` runs the check. The page depends only on the
source (docstrings, signatures, ``#:`` comments above module constants), not
on the machine: run it from the source tree, whose ``pyfa`` it imports.
"""
from __future__ import annotations

import argparse
import difflib
import importlib
import inspect
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "API.md"
REGENERATE = "python3 scripts/gen_api_docs.py"
# Public modules documented after the top-level names: their own functions,
# classes and ``#:``-commented constants.
MODULES = ["pyfa.reference", "pyfa.turboquant", "pyfa.integrations.transformers", "pyfa.integrations.torch_ops"]
# Special methods that are part of a class's public behaviour.
DUNDERS = {"__len__": "len(x)"}


class MissingDoc(Exception):
    pass


def _doc(obj, name: str) -> str:
    doc = inspect.getdoc(obj) if not isinstance(obj, property) else inspect.cleandoc(obj.__doc__ or "")
    if not doc:
        raise MissingDoc(f"{name} has no docstring")
    return doc


def _annotation(a) -> str:
    # A forward reference written in quotes stays quoted under `from __future__ import annotations`.
    return a.strip("'\"") if isinstance(a, str) else inspect.formatannotation(a)


def _default(value) -> str:
    if isinstance(value, type):
        module = {"numpy": "np"}.get(value.__module__, value.__module__)
        return f"{module}.{value.__qualname__}"
    return repr(value)


def _signature(func, drop_first: bool = False) -> str:
    """``(a, b: int = 1, *, c=None) -> T`` with annotations as written in the source."""
    sig = inspect.signature(func)
    params = list(sig.parameters.values())[1 if drop_first else 0:]
    parts, star_done = [], False
    for p in params:
        if p.kind is p.KEYWORD_ONLY and not star_done:
            parts.append("*")
            star_done = True
        if p.kind is p.VAR_POSITIONAL:
            star_done = True
        text = {p.VAR_POSITIONAL: "*", p.VAR_KEYWORD: "**"}.get(p.kind, "") + p.name
        if p.annotation is not p.empty:
            text += f": {_annotation(p.annotation)}"
        if p.default is not p.empty:
            text += f" = {_default(p.default)}" if p.annotation is not p.empty else f"={_default(p.default)}"
        parts.append(text)
    out = f"({', '.join(parts)})"
    if sig.return_annotation is not sig.empty:
        out += f" -> {_annotation(sig.return_annotation)}"
    return out


def _block(doc: str) -> list[str]:
    return ["```text", doc, "```", ""]


def _anchor(title: str) -> str:
    """GitHub's heading anchor of a heading text."""
    text = re.sub(r"[^\w\- ]", "", title.lower())
    return text.replace(" ", "-")


def _commented_constants(module) -> list[tuple[str, str]]:
    """(name, comment) of ``NAME = ...`` lines of the module's source preceded by ``#:`` lines."""
    found, comment = [], []
    for line in inspect.getsource(module).splitlines():
        if line.startswith("#:"):
            comment.append(line[2:].strip())
            continue
        match = re.match(r"^([A-Za-z]\w*)\s*(?::[^=]+)?=", line)
        if match and comment:
            found.append((match.group(1), " ".join(comment)))
        comment = []
    return found


def _heading(level: int, qualified: str, signature: str | None) -> list[str]:
    lines = [f"{'#' * level} `{qualified}`", ""]
    return lines + (["```python", f"{qualified}{signature}", "```", ""] if signature is not None else [])


def _function(qualified: str, func) -> list[str]:
    return _heading(3, qualified, _signature(func)) + _block(_doc(func, qualified))


def _members(cls) -> list[tuple[str, object]]:
    """Public methods and properties of ``cls`` and its pyfa bases, in source order."""
    seen, members = set(), []
    for klass in cls.__mro__:
        if klass is object or not klass.__module__.startswith("pyfa"):
            continue
        for name, value in vars(klass).items():
            if name in seen or (name.startswith("_") and name not in DUNDERS):
                continue
            if isinstance(value, (staticmethod, classmethod)):
                value = value.__func__
            if inspect.isfunction(value) or isinstance(value, property):
                seen.add(name)
                members.append((name, value))
    return members


def _class(qualified: str, cls) -> list[str]:
    bases = [b.__name__ for b in cls.__bases__ if b is not object]
    if issubclass(cls, BaseException):
        lines = _heading(3, qualified, None) + [f"Subclass of {', '.join(f'`{b}`' for b in bases)}.", ""]
    else:
        lines = _heading(3, qualified, _signature(cls.__init__, drop_first=True))
    lines += _block(_doc(cls, qualified))
    if issubclass(cls, BaseException):
        return lines
    short = cls.__name__
    for name, value in _members(cls):
        doc = _block(_doc(value, f"{qualified}.{name}"))
        if isinstance(value, property):
            lines += [f"#### `{short}.{name}` (property)", ""] + doc
        elif name in DUNDERS:
            lines += [f"#### `{short}.{name}`: `{DUNDERS[name]}`", ""] + doc
        else:
            sig = _signature(value, drop_first=not isinstance(inspect.getattr_static(cls, name), staticmethod))
            lines += _heading(4, f"{short}.{name}", sig) + doc
    return lines


def _data(qualified: str, value, comment: str) -> list[str]:
    return [f"### `{qualified}`", "", f"`{qualified} = {value!r}`: {comment}", ""]


def render() -> str:
    sys.path.insert(0, str(ROOT))
    import pyfa

    functions, classes, errors, data, modules = [], [], [], [], []
    top_constants = {}  # name in pyfa.__all__ -> the `#:` comment where that very object is assigned
    for modname in sorted(m for m in sys.modules if m == "pyfa" or m.startswith("pyfa.")):
        module = sys.modules[modname]
        for name, comment in _commented_constants(module):
            if name in pyfa.__all__ and getattr(module, name, None) is getattr(pyfa, name):
                top_constants[name] = comment
    for name in pyfa.__all__:
        obj = getattr(pyfa, name)
        if inspect.ismodule(obj):
            continue  # documented with MODULES
        if inspect.isclass(obj) and issubclass(obj, BaseException):
            errors.append(name)
        elif inspect.isclass(obj):
            classes.append(name)
        elif inspect.isfunction(obj):
            functions.append(name)
        elif name in top_constants:
            data.append(name)
        else:
            raise MissingDoc(f"pyfa.{name}: not a function, class or module, and no `#:` comment above its "
                             "assignment says what it is")
    for name in pyfa.__all__:
        if inspect.ismodule(getattr(pyfa, name)) and getattr(pyfa, name).__name__ not in MODULES:
            raise MissingDoc(f"pyfa.{name}: a module in pyfa.__all__ missing from MODULES in {__file__}")
    errors.sort(key=lambda n: (n != "PyfaError", n))

    out = ["# pyfa Python API", "",
           f"Generated from the docstrings by `{REGENERATE}`; `tests/test_api_docs.py` fails when this page",
           "is stale. How the conventions (layouts, GQA, causal alignment, windows, LSE) map to flash-attn's",
           "and torch's: [README.md, \"Conventions for flash-attn and torch users\"]"
           "(../README.md#conventions-for-flash-attn-and-torch-users).", ""]
    sections = [("Functions", [(n, _function(f"pyfa.{n}", getattr(pyfa, n))) for n in sorted(functions)]),
                ("Classes", [(n, _class(f"pyfa.{n}", getattr(pyfa, n))) for n in sorted(classes)]),
                ("Exceptions", [(n, _class(f"pyfa.{n}", getattr(pyfa, n))) for n in errors]),
                ("Data", [(n, _data(f"pyfa.{n}", getattr(pyfa, n), top_constants[n])) for n in sorted(data)])]
    for modname in MODULES:
        module = importlib.import_module(modname)
        entries = [(modname, _block(_doc(module, modname)))]
        for name, value in vars(module).items():
            if name.startswith("_") or getattr(value, "__module__", None) != modname:
                continue
            if getattr(pyfa, name, None) is value:
                entries.append((name, [f"`{modname}.{name}` is `pyfa.{name}` (above).", ""]))
            elif inspect.isfunction(value):
                entries.append((name, _function(f"{modname}.{name}", value)))
            elif inspect.isclass(value):
                entries.append((name, _class(f"{modname}.{name}", value)))
        for name, comment in _commented_constants(module):
            entries.append((name, _data(f"{modname}.{name}", getattr(module, name), comment)))
        modules.append((modname, entries))

    out += ["## Contents", ""]
    for title, entries in sections:
        if entries:
            names = ", ".join(f"[`{n}`](#{_anchor('pyfa.' + n)})" for n, _ in entries)
            out.append(f"- [{title}](#{_anchor(title)}): {names}")
    for modname, entries in modules:
        out.append(f"- [`{modname}`](#{_anchor(modname)})")
    out.append("")
    for title, entries in sections:
        if not entries:
            continue
        out += [f"## {title}", ""]
        for _, lines in entries:
            out += lines
    for modname, entries in modules:
        out += [f"## {modname}", ""]
        for _, lines in entries:
            out += lines
    return "\n".join(out).rstrip() + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if docs/API.md differs from what would be written")
    args = ap.parse_args(argv)
    try:
        page = render()
    except MissingDoc as e:
        print(f"gen_api_docs: {e}", file=sys.stderr)
        return 1
    if args.check:
        current = PAGE.read_text() if PAGE.is_file() else ""
        if current != page:
            diff = difflib.unified_diff(current.splitlines(), page.splitlines(), "docs/API.md", "generated", lineterm="")
            print("\n".join(list(diff)[:40]), file=sys.stderr)
            print(f"gen_api_docs: docs/API.md is stale; run `{REGENERATE}`", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(page)
    print(f"wrote {PAGE.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
