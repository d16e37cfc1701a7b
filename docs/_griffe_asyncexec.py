"""A griffe extension for the API reference (mkdocs.yml loads it; it is not part of the package).

The docstrings are Google style with a few reStructuredText habits that Markdown does not know.
After griffe has loaded ``asyncexec``, this rewrites, in the loaded copy only:

- roles: ``:class:`Step``` becomes a link to ``asyncexec.Step`` when the name is public (it is in
  ``asyncexec.__all__`` or ``asyncexec.backends``), else the name in a code span;
- literal-block markers: a paragraph ending in ``::`` ends in ``:`` (the indented block after
  it is a code block in Markdown too), and a line of only ``::`` is dropped;
- parameter defaults written as ``_D.name`` (the executor's and the pool's defaults come from
  ``ExecutorConfig``): the value the class attribute has in the source, so that the reference
  shows ``placement_timeout_s: float = 60.0`` rather than the attribute's name.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Any

import griffe

_ROLE = re.compile(r":(?:class|func|meth|attr|data|exc|obj|mod):`(~?)([^`]+)`(\\ )?")
_BACKENDS = {"Backend", "GroupHandle", "TorchBackend"}
_TORCH = {"get_device"}


def _public_names() -> set[str]:
    """``asyncexec.__all__``, read from the source (the keys of ``_EXPORTS``), not imported."""
    init = Path(__file__).resolve().parent.parent / "asyncexec" / "__init__.py"
    for node in ast.walk(ast.parse(init.read_text())):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and node.target.id == "_EXPORTS"
            and isinstance(node.value, ast.Dict)
        ):
            return {
                k.value
                for k in node.value.keys
                if isinstance(k, ast.Constant) and isinstance(k.value, str)
            }
    raise RuntimeError("asyncexec/__init__.py has no _EXPORTS mapping")


class AsyncexecDocstrings(griffe.Extension):
    """Rewrites the loaded docstrings and defaults as the module docstring says."""

    def __init__(self) -> None:
        super().__init__()
        self._public = _public_names()

    def _target(self, path: str) -> str | None:
        """The reference page's identifier for a role's target, or None when it has none."""
        parts = [p for p in path.split(".") if p]
        if parts[:2] == ["asyncexec", "backends"]:
            parts = parts[2:]
            if parts[:1] == ["torch"]:
                parts = parts[1:]
        elif parts[:1] == ["asyncexec"]:
            parts = parts[1:]
        # Relative or private paths (``._pool.WorkerPool``, ``asyncexec._driver._run.Run``):
        # keep the public tail.
        while parts and parts[0].startswith("_") and len(parts) > 1:
            parts = parts[1:]
        if not parts or any(p.startswith("_") for p in parts):
            return None
        head, rest = parts[0], parts[1:]
        if len(rest) > 1:
            return None
        if head in self._public:
            return ".".join(["asyncexec", head, *rest])
        if head in _BACKENDS:
            return ".".join(["asyncexec.backends", head, *rest])
        if head in _TORCH and not rest:
            return f"asyncexec.backends.torch.{head}"
        return None

    def _role(self, match: re.Match[str]) -> str:
        short, path = match.group(1), match.group(2)
        text = path.rsplit(".", 1)[-1] if short else path.lstrip(".")
        target = self._target(path)
        return f"[`{text}`][{target}]" if target else f"`{text}`"

    def _rewrite(self, text: str) -> str:
        text = _ROLE.sub(self._role, text)
        lines = []
        for line in text.split("\n"):
            stripped = line.rstrip()
            if stripped.strip() == "::":
                continue
            if stripped.endswith("::"):
                line = stripped[:-1]
            lines.append(line)
        return "\n".join(lines)

    def _default(self, func: griffe.Function, default: Any) -> Any:
        """The source value of a ``_D.name`` default, else the default as it is."""
        if not isinstance(default, griffe.ExprAttribute) or len(default.values) != 2:
            return default
        first, attr = default.values
        if not isinstance(first, griffe.ExprName) or not isinstance(attr, griffe.ExprName):
            return default
        holder = func.module.members.get(first.name)
        if holder is None or holder.is_alias or not isinstance(holder, griffe.Attribute):
            return default
        cls_name = holder.value
        if not isinstance(cls_name, griffe.ExprName):
            return default
        try:
            cls = func.modules_collection[cls_name.canonical_path]
        except KeyError:
            return default
        member = cls.members.get(attr.name)
        if member is None or member.is_alias or getattr(member, "value", None) is None:
            return default
        return member.value

    def _visit(self, obj: griffe.Object, seen: set[str]) -> None:
        if obj.path in seen:
            return
        seen.add(obj.path)
        if obj.docstring is not None:
            obj.docstring.value = self._rewrite(obj.docstring.value)
        if isinstance(obj, griffe.Function):
            for parameter in obj.parameters:
                parameter.default = self._default(obj, parameter.default)
        for member in obj.members.values():
            if not member.is_alias:
                self._visit(member, seen)  # type: ignore[arg-type]

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        if pkg.name == "asyncexec":
            self._visit(pkg, set())
