"""Issue 15: ``djinn/frontend`` has no import circle, counting imports inside functions
(which is how a circle hides), and only the extension-points module touches PyTorch's
extension points."""

from __future__ import annotations

import ast
from pathlib import Path

FRONTEND = Path(__file__).resolve().parents[2] / "djinn" / "frontend"


def _imports(path: Path) -> set[str]:
    """Sibling modules ``path`` imports anywhere, except under ``if TYPE_CHECKING:``."""
    tree = ast.parse(path.read_text())
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for n in ast.walk(node))
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip or not isinstance(node, ast.ImportFrom):
            continue
        if node.level == 1 and node.module:
            found.add(node.module.split(".")[0])
        elif node.level == 1:
            found.update(alias.name for alias in node.names)
        elif node.module and node.module.startswith("djinn.frontend."):
            found.add(node.module.split(".")[2])
    modules = {p.stem for p in FRONTEND.glob("*.py")}
    return {m for m in found if m in modules and m != path.stem}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for dep in sorted(graph.get(m, ())):
            if state.get(dep) == 1:
                return [*stack[stack.index(dep) :], dep]
            if dep not in state and (found := visit(dep)):
                return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_frontend_imports_form_no_cycle():
    graph = {p.stem: _imports(p) for p in FRONTEND.glob("*.py")}
    assert _cycle(graph) is None, " -> ".join(_cycle(graph) or [])


def test_only_the_extension_points_module_patches_or_registers_with_torch():
    markers = (
        "torch.library.Library(",
        "register_module_forward",
        "register_module_parameter_registration_hook",
        "register_package(",
        "_setup_privateuseone_for_python_backend(",
        "setattr(torch",
        "torch.nn.Module.to =",
        "torch.tensor =",
    )
    offenders = [
        f"{p.name}: {m}"
        for p in FRONTEND.glob("*.py")
        if p.name != "extension_points.py"
        for m in markers
        if m in p.read_text()
    ]
    assert offenders == []
