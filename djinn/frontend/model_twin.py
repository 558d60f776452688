"""Whether the appliance would run the model the program has.

Note [the model the appliance builds]: the model path registers a model as its class,
its config and its weights; the appliance builds ``cls(config)`` on the meta device and
loads the weights into it (appliance/models.py ``build``). Whatever the program changed
in the module itself, and that neither the config nor the weights carry, was silently
not there (a review): every block's activation swapped for ``ReLU``, a layer norm's
``eps`` set on the module, an ``lm_head`` given weights of its own while the config still
ties them (the build ties them again), a model built with ``attn_implementation=
"eager"`` (not in ``config.to_dict()``, so sdpa ran, other numbers at padded positions).
Layers dropped from ``transformer.h`` were refused as "weights missing", where eager runs.

So before a move takes the model path, the client builds the same twin on the meta
device, from the config as the appliance will get it (a few ms for GPT-2 small), and
compares: each submodule's name and class, its plain attributes (numbers, strings,
flags, functions), each parameter's and buffer's name and shape, and which parameters
are one (ties). A difference sends the model down the graph path, which runs the local
module as it is, with a warning naming the first difference. The attention
implementation travels in the config (``attn_implementation``, eager or sdpa, which the
appliance accepts): a model built with eager attention keeps the model path and runs it.

Two differences the twin cannot show, since it is built from the same classes in the same
process (a review; both silently other numbers):
- Code patched into a class (a kernel library's ``GPT2MLP.forward = fast_mlp``, a class
  swapped into the modeling module before ``from_pretrained``). The appliance imports the
  classes afresh and runs the unpatched code: 0.126 off. So every function of every class
  the model is made of must come from the files of the model's own package, torch or
  Python's standard library (``_foreign_code``); a function set on a module instance,
  over its class's, is another function too.
- State a module keeps between calls. Dynamic RoPE (``rope_type`` "dynamic") recomputes
  its frequencies from the longest sequence it has seen, so each copy's numbers depend on
  its own history. The appliance keeps one module per checkpoint, shared by every
  program (and every copy) registering those weights: after copy A ran 30 tokens, copy
  B's first 20-token call was 6.1e-5 off eager. Such a model runs on the graph path,
  where its state is the local module's own.
"""

from __future__ import annotations

import ast
import functools
import json
import os
import site
import sys
import sysconfig
import types
import warnings
from typing import Any

import torch

from .model_changes import MISSING, same_value

# attributes a build sets from the config or for its own bookkeeping: not the module's
# computation, or compared through the config itself
_SKIPPED = frozenset({"training", "config", "generation_config", "name_or_path"})
# settings that change no eval-mode output (checkpointing acts only while training;
# gradient_checkpointing_enable() sends no model to the graph path: a review)
_NO_OUTPUT = frozenset({"gradient_checkpointing"})


def config_dict(module: torch.nn.Module) -> dict[str, Any]:
    """The config as the appliance gets it: ``to_dict()``, plus the attention
    implementation where it is one the appliance runs."""
    config = module.config
    out = config.to_dict()
    attn = getattr(config, "_attn_implementation", None)
    if attn in ("eager", "sdpa"):
        out["attn_implementation"] = attn
    return out


def difference(module: torch.nn.Module) -> str | None:
    """The first way ``module`` differs from what the appliance builds of its class and
    config, or None (Note [the model the appliance builds])."""
    cls, config = type(module), module.config
    config_class = getattr(cls, "config_class", None) or type(config)
    try:
        wire = json.loads(json.dumps(config_dict(module), default=str))
        with torch.device("meta"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            twin = cls(config_class.from_dict(wire))
    except Exception as exc:  # the appliance could not build it either
        return f"its class does not build from its config here ({type(exc).__name__}: {exc})"
    if getattr(twin.config, "_attn_implementation", None) != getattr(
        config, "_attn_implementation", None
    ):
        return (
            f"its attention implementation is {config._attn_implementation!r}, its config "
            f"builds {twin.config._attn_implementation!r}"
        )
    mine = dict(module.named_modules(remove_duplicate=False))
    built = dict(twin.named_modules(remove_duplicate=False))
    foreign = _foreign_code(mine.values(), _package(cls))
    if foreign is not None:
        return foreign
    for name, m in mine.items():
        if "dynamic" in _rope_types(m):
            return (
                f"{name or 'it'} recomputes its rotary frequencies from the longest sequence "
                "it has seen (dynamic RoPE), state the appliance's one copy would share "
                "between programs"
            )
    if mine.keys() != built.keys():
        name = sorted(mine.keys() ^ built.keys())[0]
        return f"its submodule {name!r} was {'added' if name in mine else 'removed'}"
    for name, m in mine.items():
        b = built[name]
        if type(m) is not type(b) and not _same_parametrized(m, b):
            return f"{name or 'it'} is a {type(m).__name__}, its config builds a {type(b).__name__}"
        what = _attributes_differ(m, b)
        if what is not None:
            return f"{name + '.' if name else ''}{what}"
    for kind in ("parameters", "buffers"):
        got = _shapes(getattr(module, f"named_{kind}")(remove_duplicate=False))
        want = _shapes(getattr(twin, f"named_{kind}")(remove_duplicate=False))
        if got != want:
            name = sorted(set(got.items()) ^ set(want.items()))[0][0]
            return f"its {kind[:-1]} {name!r} is not one its config builds, or of another shape"
    if _ties(module) != _ties(twin):
        return "its parameters are tied otherwise than its config ties them"
    return None


def _attributes_differ(m: torch.nn.Module, b: torch.nn.Module) -> str | None:
    mine, built = vars(m), vars(b)
    for key in sorted(mine.keys() - built.keys()):
        if not key.startswith("_") and callable(mine[key]) and hasattr(type(m), key):
            return f"{key} is another function (set on the module, over its class's)"
    # a setting only the local module has is one its class's code never reads (a
    # library's bookkeeping: resize_token_embeddings sets vocab_size there; a review)
    for key in sorted(built):
        if key.startswith("_") or key in _SKIPPED or key in _NO_OUTPUT:
            continue
        a, z = mine.get(key, MISSING), built.get(key, MISSING)
        if isinstance(a, (torch.Tensor, torch.nn.Module)) or isinstance(
            z, (torch.Tensor, torch.nn.Module)
        ):
            continue  # compared as parameters, buffers and submodules
        if hasattr(a, "to_dict") and hasattr(z, "to_dict"):
            continue  # a config: the one the appliance gets
        if callable(a) and callable(z):
            if not _same_function(a, z):
                return f"{key} is another function"
            continue
        if a is MISSING:
            return f"{key} was removed"
        if not same_value(a, z):
            return f"{key} = {a!r} (its config builds {z!r})"
    return None


def _shapes(named: Any) -> dict[str, tuple[int, ...]]:
    return {name: tuple(t.shape) for name, t in named}


def _ties(module: torch.nn.Module) -> set[frozenset[str]]:
    groups: dict[int, set[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), set()).add(name)
    return {frozenset(g) for g in groups.values() if len(g) > 1}


def _same_function(a: Any, z: Any) -> bool:
    """One function: a bound method's, or a ``functools.partial`` of one function with the
    same arguments, made anew by each module (Gemma's ``GELUTanh``: a review)."""
    if isinstance(a, functools.partial) and isinstance(z, functools.partial):
        return (
            _same_function(a.func, z.func)
            and same_value(a.args, z.args)
            and same_value(a.keywords, z.keywords)
        )
    return getattr(a, "__func__", a) is getattr(z, "__func__", z)


def _same_parametrized(m: torch.nn.Module, b: torch.nn.Module) -> bool:
    """Both given parametrizations of one class: ``torch.nn.utils.parametrize`` makes a new
    class for each module it parametrizes (Wav2Vec2's weight-normed convolution)."""
    from torch.nn.utils import parametrize

    return (
        parametrize.is_parametrized(m)
        and parametrize.is_parametrized(b)
        and type(m).__bases__ == type(b).__bases__
    )


def _rope_types(m: torch.nn.Module) -> set[str]:
    kind = vars(m).get("rope_type")
    if isinstance(kind, dict):  # one per layer type (Gemma3's sliding and full layers)
        return {str(v) for v in kind.values()}
    return {str(kind)} if kind is not None else set()


def _package(cls: type) -> str:
    return cls.__module__.partition(".")[0]


@functools.lru_cache(maxsize=64)
def _roots(package: str) -> tuple[tuple[str, ...], tuple[str, ...], str]:
    """Where the code the appliance runs as the client does lies: the folders of the
    model's package (transformers), torch and Djinn's own wrappers
    (``djinn.hook_transformers()``'s ``from_pretrained``: a review), none of which changes
    what a forward computes; and Python's standard library, less the folders of installed
    packages, which lie inside it in a pyenv, conda or Docker Python (a review: a kernel
    library counted as the standard library there)."""
    allowed = []
    for name in (package, "torch", "typing_extensions", "djinn"):
        file = getattr(sys.modules.get(name), "__file__", None)
        if file:  # a package's folder; a single-file module (typing_extensions) itself
            allowed.append(os.path.dirname(file) if file.endswith("__init__.py") else file)
    paths = sysconfig.get_paths()
    installed = [paths["purelib"], paths["platlib"], *site.getsitepackages()]
    installed.append(site.getusersitepackages())
    for folder in ("site-packages", "dist-packages"):  # the base Python's, under a venv
        installed.append(os.path.join(paths["stdlib"], folder))
    real = lambda ps: tuple(sorted({os.path.realpath(p) for p in ps}))  # noqa: E731
    return real(allowed), real(installed), os.path.realpath(paths["stdlib"])


# the namespaces a model's code calls into besides its classes: a function patched there
# (``F.gelu`` before the build, ``F.scaled_dot_product_attention``) ran unpatched on the
# appliance (a review: 0.25 and 0.15 off)
_CALLED = (torch, torch.nn.functional, torch.Tensor)


def _foreign_code(modules: Any, package: str) -> str | None:
    """The first function the model runs whose code lies outside ``_roots``: patched in,
    so not what the appliance runs (Note [the model the appliance builds]). Every
    function of the classes of its modules and their bases, of the modules defining them
    (``modeling_llama.apply_rotary_pos_emb = fast``, a kernel library's way), and of
    torch's namespaces the code calls."""
    roots = _roots(package)
    classes: dict[type, None] = {}
    for m in modules:
        for klass in type(m).__mro__:
            if klass is not object:
                classes.setdefault(klass)
    places: list[tuple[str, dict[str, Any]]] = [(k.__name__, vars(k)) for k in classes]
    for name in {klass.__module__: None for klass in classes}:
        namespace = vars(sys.modules[name]) if name in sys.modules else {}
        own = _functions_defined(namespace.get("__file__") or "")
        places.append((name, {k: v for k, v in namespace.items() if k in own}))
    places += [(getattr(ns, "__name__", "torch"), vars(ns)) for ns in _CALLED]
    for owner, namespace in places:
        for key, value in list(namespace.items()):
            where = _outside(value, roots, package)
            if where is not None:
                return (
                    f"{owner}.{key} runs code from {where}, not {package}'s own, which "
                    "the appliance runs (patched in?)"
                )
    return None


@functools.lru_cache(maxsize=256)
def _functions_defined(filename: str) -> frozenset[str]:
    """The names a module's source binds with ``def`` at its top level: the functions it
    defines itself (what it imports from elsewhere is other packages' code, rightly)."""
    try:
        with open(filename, encoding="utf-8") as f:
            tree = ast.parse(f.read(), filename)
    except (OSError, SyntaxError, ValueError):
        return frozenset()
    return frozenset(
        n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
    )


def _outside(value: Any, roots: tuple, package: str) -> str | None:
    """Where ``value``'s code lies if outside ``roots``; None for code inside them and for
    what is not a function."""
    for _ in range(16):  # each wrapper, then what it wraps
        if isinstance(value, (staticmethod, classmethod)):
            value = value.__func__
        elif isinstance(value, property):
            value = value.fget
        elif isinstance(
            value, (functools.partial, functools.partialmethod, functools.cached_property)
        ):
            value = value.func
        else:
            break
    for _ in range(16):  # a decorator's wrapper, then what it wraps
        code = getattr(value, "__code__", None)
        if isinstance(code, types.CodeType):
            if not _inside(code.co_filename, roots):
                return code.co_filename
        elif isinstance(value, types.BuiltinFunctionType):
            home = (getattr(value, "__module__", None) or "builtins").partition(".")[0]
            known = home in sys.stdlib_module_names or home in ("torch", package, "builtins")
            return None if known else f"the compiled module {home}"
        else:
            return None  # not a function: a class, a constant, a descriptor
        value = getattr(value, "__wrapped__", None)
        if isinstance(value, (functools.partial, functools.partialmethod)):
            value = value.func
    return None


@functools.lru_cache(maxsize=4096)
def _inside(filename: str, roots: tuple) -> bool:
    allowed, installed, stdlib = roots
    if filename.startswith("<frozen "):  # the standard library's frozen modules (abc)
        return True
    path = os.path.realpath(filename)
    under = lambda r: path == r or path.startswith(r + os.sep)  # noqa: E731
    if any(under(r) for r in allowed):
        return True
    return not any(under(r) for r in installed) and under(stdlib)
