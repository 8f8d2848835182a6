"""Where a run's plain ``nn.Module`` came from, and how it was built: recorded at capture time, checked at replay.

A model class defined in the user's own module beside the training script (``mymodel.Net(d=64, layers=3)``)
imports in the run because Python put the script's folder first on ``sys.path``; ``ampdoctor triage`` does not
run that script, so the folder is not there. At capture time (``record``, no user code runs):

- ``import_root``: the folder the class's module was imported from, relative to the run's working folder
  (``"."`` when the script ran from its own folder), its ``module_file`` there and the file's sha256; only for
  the user's own code (nothing installed: site-packages, the interpreter's own library);
- ``init_args``: the constructor's arguments as Python literals (``{"d": "64", "layers": "3"}``), read from
  the one call of the class in the training script's text (``ast``: the script is read, never run), else from
  the instance's own attributes of the same name (``self.d = d``); ``init_unknown``: the ones neither says.

At replay (``import_folder``, ``init_kwargs``): the recorded folder goes first on ``sys.path`` as the run had it,
only when it is this folder or one inside it and not inside the capture (a capture's own files never run);
anything else asks for ``--import-outside``. The arguments are parsed with ``ast.literal_eval`` (values, never
code).
"""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import importlib.util
import inspect
import os
import sys
import sysconfig
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ampdoctor.errors import SpecError

MAX_LITERAL = 2000
"""The longest constructor argument a capture may hold (characters of its literal)."""
OUTSIDE_FLAG = "--import-outside"


def _installed(path: Path) -> bool:
    """Code that imports without the script's folder: the interpreter's library, site-packages, the environment."""
    parts = set(path.parts)
    if "site-packages" in parts or "dist-packages" in parts:
        return True
    roots = {sys.prefix, sys.base_prefix, *(sysconfig.get_paths().get(k, "") for k in ("stdlib", "platstdlib"))}
    return any(r and path.is_relative_to(Path(r).resolve()) for r in roots)


def _module_root(module: str, file: Path) -> Path | None:
    """The folder on ``sys.path`` that ``module`` (``a.b.c``) was imported from, given its file."""
    depth = module.count(".") + (1 if file.stem == "__init__" else 0)
    root = file.parent
    for _ in range(depth):
        root = root.parent
    return root


def _sha256(path: Path) -> str | None:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return None


def _literal(node: ast.expr) -> str | None:
    """The node's source when it is a Python literal (a number, string, tuple...), else None."""
    try:
        ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return None
    text = ast.unparse(node)
    return text if len(text) <= MAX_LITERAL else None


def _script_call(cls: type) -> tuple[list[str | None], dict[str, str | None]] | None:
    """The arguments of the one call of ``cls`` in the running script's text (positional, keyword; None where an
    argument is not a literal); None when the script has no such call, or several that differ."""
    main = sys.modules.get("__main__")
    f = getattr(main, "__file__", None)
    if not f:
        return None
    try:
        tree = ast.parse(Path(f).read_text(encoding="utf-8"))
    except (OSError, SyntaxError, ValueError, UnicodeDecodeError):
        return None
    names = {cls.__name__} | {a.asname for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
                              for a in n.names if a.name == cls.__name__ and a.asname}
    calls = set()
    for n in ast.walk(tree):
        if not isinstance(n, ast.Call):
            continue
        fn = n.func
        name = fn.id if isinstance(fn, ast.Name) else fn.attr if isinstance(fn, ast.Attribute) else None
        if name not in names:
            continue
        if any(isinstance(a, ast.Starred) for a in n.args) or any(k.arg is None for k in n.keywords):
            return None  # *args / **kwargs: not known from the text
        calls.add((tuple(_literal(a) for a in n.args), tuple((str(k.arg), _literal(k.value)) for k in n.keywords)))
    if len(calls) != 1:
        return None
    pos, kw = calls.pop()
    return list(pos), dict(kw)


_ABSENT = object()


DATACLASS = "__dataclass__"
"""The key of a constructor argument recorded as a dataclass of literals: ``{"__dataclass__": "model.GPTConfig",
"fields": {...}}`` (``self.config = config``, nanoGPT's ``GPT(GPTConfig(...))``)."""


def _dataclass_literal(value: Any, owner: type | None) -> str | None:
    """A dataclass instance whose fields are all plain literals, defined in the model class's own module
    (``owner``'s: the one the replay imports anyway), as the literal of a dict that ``init_kwargs`` reads back."""
    if owner is None or not dataclasses.is_dataclass(value) or isinstance(value, type):
        return None
    cls = type(value)
    if cls.__module__ != owner.__module__ or "<locals>" in cls.__qualname__:
        return None
    fields: dict[str, Any] = {}
    for f in dataclasses.fields(value):
        v = getattr(value, f.name, _ABSENT)
        text = _attr_literal(v)
        if text is None:
            return None
        fields[f.name] = ast.literal_eval(text)
    text = repr({DATACLASS: f"{cls.__module__}.{cls.__qualname__}", "fields": fields})
    return text if len(text) <= MAX_LITERAL else None


def _attr_literal(value: Any, owner: type | None = None) -> str | None:
    """``repr`` of a plain value (numbers, strings, booleans, None, and tuples/lists of them) that reads back; with
    ``owner`` (the model class), a dataclass of such values defined beside it (``_dataclass_literal``)."""
    if value is _ABSENT:
        return None
    if owner is not None and dataclasses.is_dataclass(value):
        return _dataclass_literal(value, owner)
    if isinstance(value, (bool, int, float, str, type(None))) or (
            isinstance(value, (tuple, list)) and all(isinstance(v, (bool, int, float, str, type(None))) for v in value)):
        text = repr(value)
        try:
            if ast.literal_eval(text) == value and len(text) <= MAX_LITERAL:
                return text
        except (ValueError, SyntaxError):
            return None
    return None


def _init_args(cls: type, instance: Any) -> tuple[dict[str, str], list[str], str]:
    """The constructor's arguments as literals, the ones not known, and where they were read."""
    try:
        every = list(inspect.signature(cls).parameters.values())
    except (TypeError, ValueError):
        return {}, ["*"], "none"
    params = [p for p in every if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    call = _script_call(cls)
    args: dict[str, str] = {}
    # *args (nn.Sequential's modules): not known from literals or attributes
    unknown: list[str] = [f"*{p.name}" for p in every if p.kind == p.VAR_POSITIONAL]
    own = vars(instance)
    if call is not None:
        pos, kw = call
        given = {p.name: v for p, v in zip([p for p in params if p.kind != p.KEYWORD_ONLY], pos, strict=False)}
        given.update(kw)
        for p in params:
            if p.name in given:
                v = given[p.name] or _attr_literal(own.get(p.name, _ABSENT), cls)
                if v is None:
                    unknown.append(p.name)
                else:
                    args[p.name] = v
        return args, unknown, "script"
    for p in params:
        v = _attr_literal(own.get(p.name, _ABSENT), cls)
        if v is not None:
            args[p.name] = v
        else:
            unknown.append(p.name)
    return args, unknown, "attributes"


def record(instance: Any) -> dict[str, Any]:
    """What rebuilding a plain ``nn.Module`` needs (see the module docstring), as plain JSON; {} when nothing."""
    cls = type(instance)
    out: dict[str, Any] = {}
    mod = sys.modules.get(cls.__module__)
    f = getattr(mod, "__file__", None)
    if f and cls.__module__ != "__main__":
        file = Path(f).resolve()
        root = _module_root(cls.__module__, file)
        if root is not None and not _installed(file):
            try:
                rel = os.path.relpath(root, Path.cwd())
            except ValueError:  # another drive (Windows)
                rel = None
            if rel is not None:
                out["import_root"] = Path(rel).as_posix()
                out["module_file"] = file.relative_to(root).as_posix()
                out["module_sha256"] = _sha256(file)
    args, unknown, how = _init_args(cls, instance)
    out.update({"init_args": args, "init_unknown": unknown, "init_args_from": how})
    if any(c.__name__ == "LightningModule" for c in cls.__mro__):
        out["lightning"] = True  # its loss is its own training_step
    return out


def _inside(path: Path, folder: Path) -> bool:
    return path == folder or path.is_relative_to(folder)


def import_folder(identity: Mapping[str, Any], where: str, capture: Path | None, trust: bool) -> str:
    """Put the folder the run imported its model class from first on ``sys.path``, as the run had it; returns
    what the report says of it ('' when nothing was added). One line (``SpecError``) for a folder outside this
    one without ``--import-outside``, and for one inside the capture (never)."""
    root = identity.get("import_root")
    file = identity.get("module_file")
    if not (isinstance(root, str) and isinstance(file, str)):
        return ""
    here = Path.cwd().resolve()
    folder = (here / root).resolve()
    cls = identity.get("class")
    if capture is not None and _inside(folder, capture.resolve()):
        raise SpecError(f"{where}: the capture says its model class {cls} comes from {root}, which is inside the capture "
                        "itself; ampdoctor never runs a capture's own files: write a spec whose build_model() returns the model")
    target = folder / file
    if not target.is_file():
        return ""  # not here: importing says what to do
    if not _inside(folder, here) and not trust:
        raise SpecError(f"{where}: the model class {cls} was imported from {root}, outside this folder; run from the "
                        f"training script's folder, or give {OUTSIDE_FLAG} to put {root} on the import path")
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
    digest = identity.get("module_sha256")
    changed = isinstance(digest, str) and _sha256(target) != digest
    return f"{file} in {'this folder' if root == '.' else root + '/'}" + (", changed since the capture" if changed else "")


def refuse_capture_code(path: str, capture: Path | None, where: str) -> None:
    """One line when the module that would be imported for ``path`` (its top-level package) lies inside the
    capture folder: found without running it (``importlib.util.find_spec``)."""
    if capture is None:
        return
    top = path.split(".")[0]
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return
    origin = getattr(spec, "origin", None) if spec is not None else None
    locs = [origin] if origin else list(getattr(spec, "submodule_search_locations", None) or [])
    if any(_inside(Path(p).resolve(), capture.resolve()) for p in locs if p):
        raise SpecError(f"{where}: the model class {path} would be imported from the capture folder itself; ampdoctor "
                        "never runs a capture's own files: run from the training script's folder")


def init_kwargs(identity: Mapping[str, Any], where: str) -> tuple[dict[str, Any], list[str]] | None:
    """The recorded constructor arguments (literals read back, never code) and the ones not known; None when the
    capture recorded none."""
    raw = identity.get("init_args")
    if not isinstance(raw, Mapping):
        return None
    out: dict[str, Any] = {}
    for k, v in raw.items():
        if not (isinstance(k, str) and k.isidentifier() and isinstance(v, str) and len(v) <= MAX_LITERAL):
            raise SpecError(f"{where}: the capture's init_args holds {str(k)[:40]!r}, which is not a constructor "
                            "argument written as a literal; the capture is damaged")
        try:
            out[k] = ast.literal_eval(v)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            raise SpecError(f"{where}: the capture's init_args[{k!r}] is not a Python literal; the capture is damaged") from None
        if isinstance(out[k], dict) and DATACLASS in out[k]:
            out[k] = _dataclass_of(out[k], str(identity.get("class", "")), where, k)
    unknown = identity.get("init_unknown")
    return out, [str(u) for u in unknown] if isinstance(unknown, list) else []


def _dataclass_of(rec: Mapping[str, Any], model_class: str, where: str, arg: str) -> Any:
    """The dataclass a recorded argument describes, built from its fields. Only a dataclass of the model class's own
    module (already imported to build the model: nothing else is imported or run because a capture names it)."""
    path, fields = rec.get(DATACLASS), rec.get("fields")
    mod, _, qual = str(path).rpartition(".")
    own_mod = model_class.rpartition(".")[0]
    module = sys.modules.get(mod)
    cls = getattr(module, qual, None) if module is not None and mod == own_mod and "." not in qual else None
    if not (isinstance(fields, dict) and dataclasses.is_dataclass(cls) and isinstance(cls, type)):
        raise SpecError(f"{where}: the capture's init_args[{arg!r}] names {str(path)[:80]!r}, which is not a dataclass "
                        f"of the model's own module {own_mod or '?'}; the capture is damaged")
    try:
        return cls(**fields)
    except Exception as e:  # its own checks (__post_init__) refuse the recorded fields
        raise SpecError(f"{where}: {qual}(**recorded fields) raised {type(e).__name__}: {e}"[:300]) from None


def _arg_words(v: Any, raw: str | None) -> str:
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        inner = ", ".join(f"{f.name}={getattr(v, f.name)!r}" for f in dataclasses.fields(v))
        return f"{type(v).__qualname__}({inner})"
    return raw if raw is not None else repr(v)


def call_words(name: str, kwargs: Mapping[str, Any], raw: Mapping[str, Any]) -> str:
    """'Net(d=64, layers=3)' (as the capture wrote the literals; a dataclass argument as its call)."""
    return f"{name}({', '.join(f'{k}={_arg_words(v, raw.get(k))}' for k, v in kwargs.items())})"





_HEADS = {
    "NllLossBackward0": "nll_loss",
    "MseLossBackward0": "mse_loss",
    "BinaryCrossEntropyWithLogitsBackward0": "binary_cross_entropy_with_logits",
    "SmoothL1LossBackward0": "smooth_l1_loss",
    "HuberLossBackward0": "huber_loss",
}
"""The autograd node of a ``torch.nn.functional`` loss → its name (cross_entropy is nll_loss over log_softmax)."""
_VIEWS = ("ViewBackward0", "UnsafeViewBackward0", "ReshapeAliasBackward0")
_REDUCTIONS = {0: "none", 1: "mean", 2: "sum"}


def _grad_inputs(node: Any) -> list[Any]:
    return [f for f, _ in getattr(node, "next_functions", ()) if f is not None]


def loss_recipe(loss: Any) -> dict[str, Any] | None:
    """How the run's loss was computed from the model's output, read from the loss's autograd graph (no user code
    runs): a ``torch.nn.functional`` loss on the output (cast to float32, flattened to rows) and the batch's
    targets, divided by the micro-batch count or not. None when the graph is not one of those
    (``loss_fn_of`` rebuilds it)."""
    node: Any = getattr(loss, "grad_fn", None)
    if type(node).__name__ in ("DivBackward0", "MulBackward0") and len(_grad_inputs(node)) == 1:
        node = _grad_inputs(node)[0]  # an accumulated micro-batch's loss / N (the replay divides again)
    name = _HEADS.get(type(node).__name__)
    if name is None or getattr(node, "_saved_weight", None) is not None or getattr(node, "_saved_pos_weight", None) is not None:
        return None
    out: dict[str, Any] = {"fn": name, "reduction": _REDUCTIONS.get(int(getattr(node, "_saved_reduction", 1)), "mean")}
    if name == "nll_loss":
        ii = int(getattr(node, "_saved_ignore_index", -100))
        out["ignore_index"] = ii - (1 << 64) if ii >= 1 << 63 else ii
    for attr in ("beta", "delta"):
        if hasattr(node, f"_saved_{attr}"):
            out[attr] = float(getattr(node, f"_saved_{attr}"))
    ins = _grad_inputs(node)
    if len(ins) != 1:
        return None  # the target needs gradients too: not (output, target)
    node = ins[0]
    if name == "nll_loss" and type(node).__name__ == "LogSoftmaxBackward0":
        out["fn"], out["dim"] = "cross_entropy", int(node._saved_dim)
        node = (_grad_inputs(node) or [None])[0]
    for _ in range(2):  # `.float()` and `.view(-1, C)`, in either order
        kind = type(node).__name__
        if kind == "ToCopyBackward0":
            out["float"] = True
        elif kind in _VIEWS and out["fn"] in ("cross_entropy", "nll_loss"):
            out["rows"] = True
        else:
            break
        node = (_grad_inputs(node) or [None])[0]
    if out.get("dim", 1) not in (1, -1) or node is None:
        return None
    return out


def loss_fn_of(recipe: Mapping[str, Any], where: str) -> Any:
    """``loss_fn(output, target)`` from a ``loss_recipe``; one line for a recipe this version does not know."""
    import torch.nn.functional as F

    fn = recipe.get("fn")
    if fn == "model":
        return None  # the model's own output is the loss
    known = {"cross_entropy", *_HEADS.values()}
    if fn not in known or recipe.get("reduction") not in _REDUCTIONS.values():
        raise SpecError(f"{where}: the capture's loss_recipe names {str(fn)[:40]!r}, which this ampdoctor does not "
                        "know; write a spec with loss_fn(output, target)")
    kw: dict[str, Any] = {"reduction": recipe["reduction"]}
    for k in ("ignore_index", "beta", "delta"):
        if isinstance(recipe.get(k), (int, float)) and not isinstance(recipe.get(k), bool):
            kw[k] = recipe[k]
    f = getattr(F, str(fn))
    cast, rows = bool(recipe.get("float")), bool(recipe.get("rows"))

    def loss_fn(output: Any, target: Any) -> Any:
        if rows:
            output, target = output.reshape(-1, output.shape[-1]), target.reshape(-1)
        return f(output.float() if cast else output, target, **kw)

    loss_fn.__name__ = loss_fn.__qualname__ = f"{fn} (the run's, from its autograd graph)"
    return loss_fn
def replay_needs(manifest: Mapping[str, Any]) -> list[str]:
    """What a spec must give ``triage --from`` for this capture: ``build_model()`` when the capture cannot rebuild the
    model (a class defined in the script itself, constructor arguments it could not read), ``loss_fn(output,
    target)`` when the run's loss is neither the model's own nor one it read from the graph; [] for none."""
    ident = manifest.get("model_identity") or {}
    if not isinstance(ident, Mapping) or not isinstance(ident.get("class"), str):
        return ["build_model()", "loss_fn(output, target)"]
    if ident.get("transformers_config") or ident.get("lightning_hparams"):
        return []  # the model's own loss (labels in the batch), or its training_step
    needs = []
    if str(ident["class"]).startswith("__main__.") or ident.get("init_unknown") or "init_args" not in ident:
        needs.append("build_model()")
    if not isinstance(manifest.get("loss_recipe"), Mapping) and not ident.get("lightning"):
        needs.append("loss_fn(output, target)")
    return needs


__all__ = ["OUTSIDE_FLAG", "replay_needs", "call_words", "import_folder", "init_kwargs", "loss_fn_of", "loss_recipe", "record", "refuse_capture_code"]


MAX_MODULES = 20000
"""The most modules whose settings a capture records (``structure``); a larger model records none."""


def structure(model: Any) -> dict[str, str]:
    """Each module's class and settings as ``repr`` says them without its children (``Dropout(p=0.2)``,
    ``LayerNorm((64,), eps=1e-05, elementwise_affine=True)``), by name: what the weights' shapes do not show and a
    replay must match (a dropout rate, an epsilon, an activation's approximation). {} for a model of more than
    ``MAX_MODULES`` modules, or one whose modules cannot say themselves."""
    out: dict[str, str] = {}
    try:
        for name, m in model.named_modules():
            if len(out) >= MAX_MODULES:
                return {}
            out[name] = f"{_user_class(m).__name__}({m.extra_repr()})"[:MAX_LITERAL]
    except Exception:  # a module whose extra_repr raises: nothing is recorded, nothing is compared
        return {}
    return out


def _user_class(m: Any) -> type:
    """The module's class as the user wrote it: FSDP2's ``fully_shard`` swaps it for a class of its own
    (``FSDPLinear(FSDPModule, Linear)``, made in ``torch.distributed``): its user's base is the one that counts (a
    replay's spec builds ``Linear``, then shards it or not)."""
    cls = type(m)
    if cls.__module__.startswith("torch.distributed") and any(b.__name__ == "FSDPModule" for b in cls.__bases__):
        return next((b for b in cls.__bases__ if b.__name__ != "FSDPModule"), cls)
    return cls


def differences(recorded: Any, model: Any) -> list[tuple[str, str, str]]:
    """Where the model a replay built differs from the run's (``structure`` recorded in the capture): (module name,
    the run's, this one's), "" for a module one side lacks; [] when the capture recorded none."""
    if not isinstance(recorded, Mapping) or not recorded:
        return []
    now = structure(model)
    if not now:
        return []
    names = list(recorded) + [n for n in now if n not in recorded]
    return [(str(n), str(recorded.get(n, "")), now.get(n, "")) for n in names
            if not _same_settings(str(recorded.get(n, "")), now.get(n, ""))]


def _parts(text: str) -> tuple[str, list[str], dict[str, str]]:
    """``LayerNorm((4,), eps=1e-05, bias=True)`` -> ("LayerNorm", ["(4,)"], {"eps": "1e-05", "bias": "True"}): the
    top-level comma list of the settings, split outside brackets and quotes."""
    cls, _, rest = text.partition("(")
    body = rest[:-1] if rest.endswith(")") else rest
    items, depth, quote, cur = [], 0, "", ""
    for ch in body:
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            items.append(cur.strip())
            cur = ""
            continue
        cur += ch
    if cur.strip():
        items.append(cur.strip())
    pos = [i for i in items if "=" not in i.split("(")[0]]
    kw = dict(i.split("=", 1) for i in items if "=" in i.split("(")[0])
    return cls, pos, {k.strip(): v.strip() for k, v in kw.items()}


def _same_settings(a: str, b: str) -> bool:
    """Equal, or equal where both say a setting: another PyTorch version may say one more (``LayerNorm``'s
    ``bias=`` is newer), which is not a difference of the model."""
    if a == b:
        return True
    if not a or not b:
        return False
    ca, pa, ka = _parts(a)
    cb, pb, kb = _parts(b)
    return ca == cb and len(pa) == len(pb) and pa == pb and all(ka[k] == kb[k] for k in ka.keys() & kb.keys())
