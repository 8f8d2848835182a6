"""Rebuild the run's model without a spec, from what the run itself recorded.

A capture's manifest holds ``model_identity`` (``capture.state.model_identity``: the class's import path,
a transformers config with its ``attn_implementation``, a LightningModule's ``hparams``); a transformers
Trainer checkpoint folder holds ``config.json`` (its ``architectures`` name the class). From those:

- a transformers ``PreTrainedModel``: its ``config_class`` from the recorded config, the class built from it
  (the attention implementation the run used);
- a LightningModule: its class by import path, called with the recorded ``hparams``;
- any ``nn.Module`` whose class imports and whose constructor needs no argument.

Each returns the model and one sentence saying where it came from (a report note). What cannot be rebuilt
is one line (``SpecError``) saying what to write instead. No framework is imported here: a class is
imported by the path the run recorded (transformers only when a Trainer folder names its class).
"""

from __future__ import annotations

import importlib
import inspect
import json
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ampdoctor.errors import SpecError
from ampdoctor.input import origin

WRITE_SPEC = "write a spec whose build_model() returns the model (docs/spec-format.md)"


@dataclass
class Rebuilt:
    """How to build the run's model, and where it came from."""

    build: Callable[[], nn.Module]
    source: str
    """'the capture's model_identity: transformers BertForSequenceClassification from its config (sdpa attention)'."""
    unknown: list[str] = field(default_factory=list)
    """Constructor arguments the capture could not read (their defaults were used)."""
    lightning: bool = False
    """A LightningModule: without a spec's ``loss_fn`` its loss is its own ``training_step`` (``TrainingStepLoss``)."""


class TrainingStepLoss:
    """The loss of a LightningModule as the run computed it: its own ``training_step(batch, batch_idx)`` on the
    whole batch (the forward runs inside it), its returned tensor or ``["loss"]``. Used as a spec's ``loss_fn``
    (``engine.step.batch_loss`` calls ``of``); ``self.log`` there has no Trainer and is silent."""

    def __call__(self, output: Any, target: Any) -> torch.Tensor:
        raise TypeError("the LightningModule's training_step takes the whole batch; call TrainingStepLoss.of(model, batch)")

    def of(self, model: nn.Module, batch: Any) -> torch.Tensor:
        step = getattr(model, "training_step", None)
        if not callable(step):
            raise TypeError(f"{type(model).__name__} has no training_step")
        if getattr(model, "automatic_optimization", True) is False:
            raise TypeError(f"{type(model).__name__} uses manual optimization: its training_step steps the optimizer "
                            "itself; give the spec a loss_fn(output, target)")
        try:
            n = len([p for p in inspect.signature(step).parameters.values()
                     if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)])
        except (TypeError, ValueError):
            n = 2
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # self.log() without a Trainer warns at every call
            out = step(batch, 0) if n >= 2 else step(batch)
        loss = out.get("loss") if isinstance(out, Mapping) else out
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise TypeError(f"{type(model).__name__}.training_step returned {type(out).__name__}, not a scalar loss "
                            "(or a dict with 'loss'); give the spec a loss_fn(output, target)")
        return loss.reshape(())

    def __repr__(self) -> str:
        return "training_step"


def lightning_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    """The first optimizer a LightningModule's ``configure_optimizers()`` returns (an optimizer, a list or tuple of
    them, ``([optimizers], [schedulers])``, a dict with ``"optimizer"``, or a list of such dicts)."""
    got: Any = model.configure_optimizers()  # type: ignore[operator]
    for _ in range(4):
        if isinstance(got, torch.optim.Optimizer):
            return got
        if isinstance(got, Mapping):
            got = got.get("optimizer")
        elif isinstance(got, (list, tuple)) and got:
            got = got[0]
        else:
            break
    raise SpecError(f"{type(model).__name__}.configure_optimizers() returned no optimizer ampdoctor can read "
                    f"({type(got).__name__}); give the spec a build_optimizer(model)")


def import_path(path: str, where: str) -> type:
    """The class at ``module.QualName`` (the longest importable module prefix, then attributes)."""
    parts = path.split(".")
    if parts[0] == "__main__":
        raise SpecError(f"{where}: the model class {path} was defined in the training script itself, so it cannot be "
                        f"imported; move it into a module, or {WRITE_SPEC}")
    err: Exception | None = None
    for i in range(len(parts) - 1, 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:i]))
        except ImportError as e:
            err = err or e
            continue
        except Exception as e:
            raise SpecError(f"{where}: importing {'.'.join(parts[:i])} for the model class {path} raised "
                            f"{type(e).__name__}: {str(e)[:160]}; {WRITE_SPEC}") from None
        try:
            for a in parts[i:]:
                obj = getattr(obj, a)
        except AttributeError:
            break
        if isinstance(obj, type):
            return obj
        break
    why = f" ({type(err).__name__}: {str(err)[:120]})" if err is not None else ""
    raise SpecError(f"{where}: the model class {path} cannot be imported{why}; run from where the training script "
                    f"imports it (its folder on PYTHONPATH), or {WRITE_SPEC}")


def _required_args(cls: type) -> list[str]:
    try:
        sig = inspect.signature(cls)
    except (TypeError, ValueError):
        return []
    return [n for n, p in sig.parameters.items()
            if p.default is inspect.Parameter.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


def _is_lightning(cls: type) -> bool:
    return any(c.__name__ == "LightningModule" for c in cls.__mro__)


def _transformers(cls: type, config: Mapping[str, Any], attn: str | None, where: str) -> Callable[[], nn.Module]:
    config_class = getattr(cls, "config_class", None)
    if config_class is None or not callable(getattr(config_class, "from_dict", None)):
        raise SpecError(f"{where}: {cls.__name__} has no config_class to rebuild its config from; {WRITE_SPEC}")

    def build() -> nn.Module:
        cfg = config_class.from_dict(dict(config))
        if attn:
            cfg._attn_implementation = attn  # the run's own (sdpa, eager...)
        return cls(cfg)  # type: ignore[no-any-return]

    return build


def from_identity(identity: Mapping[str, Any] | None, where: str, by: str = "the capture", *,
                  capture: Path | None = None, trust: bool = False) -> Rebuilt:
    """The model a capture's ``model_identity`` describes (see the module docstring); ``by``: who recorded it.
    ``capture``: the capture's folder (none of its files is ever imported); ``trust``: ``--import-outside``."""
    if not identity or not isinstance(identity.get("class"), str):
        raise SpecError(f"{where}: the capture does not say which model it holds (no model_identity: captured before "
                        f"ampdoctor recorded it); {WRITE_SPEC}")
    path = str(identity["class"])
    folder = origin.import_folder(identity, where, capture, trust)  # the script's folder, as the run had it
    origin.refuse_capture_code(path, capture, where)
    cls = import_path(path, where)
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise SpecError(f"{where}: {path} is not a torch.nn.Module; {WRITE_SPEC}")
    name = cls.__qualname__
    cfg = identity.get("transformers_config")
    if isinstance(cfg, Mapping):
        attn = identity.get("attn_implementation")
        attn_s = attn if isinstance(attn, str) else None
        return Rebuilt(_transformers(cls, cfg, attn_s, where),
                       f"the model is {name}, rebuilt from the transformers config {by} recorded"
                       + (f" ({attn_s} attention)" if attn_s else ""))
    hp = identity.get("lightning_hparams")
    if _is_lightning(cls) and isinstance(hp, Mapping) and hp:
        kw = dict(hp)
        return Rebuilt(lambda: cls(**kw), f"the model is the LightningModule {name}({', '.join(sorted(kw))}) from "
                       f"{path}, rebuilt from the hparams {by} recorded", lightning=True)
    plain = _plain_args(cls, identity, where, folder, by)
    if plain is not None:
        return plain
    need = _required_args(cls)
    if need:
        raise SpecError(f"{where}: the model class {path} needs constructor arguments the capture did not record "
                        f"({', '.join(need[:4])}); {WRITE_SPEC}")
    return Rebuilt(lambda: cls(), f"the model is {name}(), imported from {path} as {by} recorded",
                   lightning=_is_lightning(cls))


_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)


def check_size(rb: Rebuilt, held: int, where: str) -> None:
    """Before the model is built: the recorded identity's model is built on the meta device (no memory) and its
    parameters counted against the numbers the capture's weights hold (``held``). A config edited to a huge size, or
    another model's, is refused (``SpecError``, one line: what was claimed and what was found) before anything is
    allocated; a container built without its layers (``nn.Sequential()``) is said as such."""
    try:
        with torch.device("meta"):
            model = rb.build()
    except Exception:  # the real build says what is wrong with it
        return
    claimed = sum(p.numel() for p in model.parameters())
    if claimed == 0 and held > 0 and isinstance(model, _CONTAINERS):
        kind = f"torch.nn.{type(model).__name__}"
        raise SpecError(f"{where}: the model is a {kind}, and the capture records its class, not the layers put into "
                        f"it, so it cannot be rebuilt from the capture alone; write a spec whose build_model() returns the "
                        f"same {type(model).__name__} (docs/spec-format.md)")
    if claimed > held:
        raise SpecError(f"{where}: {rb.source}: that model has {claimed:,} parameters, and the capture's weights hold "
                        f"{held:,} numbers in all; refusing to build it (the recorded model_identity was edited, or is "
                        f"another model's); {WRITE_SPEC}")


def _plain_args(cls: type, identity: Mapping[str, Any], where: str, folder: str, by: str) -> Rebuilt | None:
    """A plain ``nn.Module`` built with the constructor arguments the capture recorded (``input.origin``); None
    when it recorded none. Arguments it could not read keep their defaults (the weights' shapes then say whether
    that is the run's model); a required one is one line."""
    got = origin.init_kwargs(identity, where)
    if got is None:
        return None
    kwargs, unknown = got
    path = str(identity["class"])
    need = [n for n in _required_args(cls) if n not in kwargs]
    if need:
        raise SpecError(f"{where}: the model class {path} needs constructor arguments the capture could not read "
                        f"({', '.join(need[:4])}: not literals in the training script); {WRITE_SPEC}")
    raw = identity.get("init_args") or {}
    call = origin.call_words(cls.__qualname__, kwargs, raw)
    defaults = [n for n in unknown if n not in kwargs]
    tail = (f"; {', '.join(defaults[:4])} not known, so {'its' if len(defaults) == 1 else 'their'} default"
            f"{'' if len(defaults) == 1 else 's'}") if defaults else ""
    src = f" ({folder})" if folder else ""
    return Rebuilt(lambda: cls(**kwargs), f"the model is {call}, imported from {path}{src} with the arguments {by} "
                   f"recorded{tail}", unknown=defaults, lightning=_is_lightning(cls))


def from_checkpoint(path: str | Path, obj_hparams: Mapping[str, Any] | None = None, attn: str | None = None) -> Rebuilt:
    """The model of a checkpoint that says how to build it: a transformers Trainer folder's ``config.json``
    (``architectures`` names the class, ``model_type`` its config). config.json does not record the attention
    implementation the run used: ``attn`` (``--attn-implementation``) says it, else transformers' default.
    A Lightning ``.ckpt`` holds the hparams but not the class, unless ``AmpDoctorCallback`` watched the run (its
    callback state holds the ``model_identity``); without it, that is one line."""
    p = Path(path)
    cfg_file = p / "config.json" if p.is_dir() else None
    if cfg_file is not None and cfg_file.is_file():
        try:
            config = json.loads(cfg_file.read_text())
        except (OSError, ValueError) as e:
            raise SpecError(f"{cfg_file}: cannot be read as JSON ({e}); {WRITE_SPEC}") from None
        archs = config.get("architectures") if isinstance(config, dict) else None
        if not (isinstance(archs, list) and archs and isinstance(archs[0], str)):
            raise SpecError(f"{cfg_file}: names no architectures, so the model class is not known; {WRITE_SPEC}")
        cls = import_path(f"transformers.{archs[0]}", str(cfg_file))
        saved = config.get("_attn_implementation") or config.get("attn_implementation")
        use = attn or (saved if isinstance(saved, str) else None)
        how = (f"{use} attention" + (" (--attn-implementation)" if attn else "") if use else
               "transformers' default attention: config.json does not record the run's; give --attn-implementation "
               "eager if the run used eager")
        return Rebuilt(_transformers(cls, config, use, str(cfg_file)), f"the model is {archs[0]}, rebuilt from "
                       f"{p.name}/config.json with {how}")
    ident = lightning_identity(p)
    if ident is not None:
        if obj_hparams is not None:
            ident = {**ident, "lightning_hparams": dict(obj_hparams)}
        return from_identity(ident, str(p), by=f"{p.name} (AmpDoctorCallback's state)")
    if obj_hparams is not None:
        raise SpecError(f"{p}: a Lightning checkpoint holds the hyper_parameters ({', '.join(sorted(obj_hparams)[:4])}) "
                        f"but not the LightningModule's class; {WRITE_SPEC}, e.g. `return MyModule.load_from_checkpoint(path)`")
    raise SpecError(f"{p}: the checkpoint does not say how to build its model (no config.json); {WRITE_SPEC}")


def _ckpt(path: Path) -> Mapping[str, Any] | None:
    if not path.is_file():
        return None
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:
        return None
    return obj if isinstance(obj, Mapping) else None


def lightning_identity(path: str | Path) -> Mapping[str, Any] | None:
    """The ``model_identity`` a Lightning ``.ckpt`` holds when ``AmpDoctorCallback`` watched the run (its callback
    state), or None."""
    obj = _ckpt(Path(path))
    states = obj.get("callbacks") if obj is not None else None
    if not isinstance(states, Mapping):
        return None
    for key, st in states.items():
        if str(key).startswith("AmpDoctorCallback") and isinstance(st, Mapping) and isinstance(st.get("model_identity"), Mapping):
            return st["model_identity"]  # type: ignore[no-any-return]
    return None


def is_lightning(model: nn.Module) -> bool:
    return _is_lightning(type(model))


def lightning_hparams(path: str | Path) -> Mapping[str, Any] | None:
    """A Lightning ``.ckpt``'s ``hyper_parameters``, or None (anything else, or unreadable)."""
    p = Path(path)
    if not p.is_file():
        return None
    try:
        obj = torch.load(p, map_location="cpu", weights_only=True, mmap=True)
    except Exception:
        return None
    hp = obj.get("hyper_parameters") if isinstance(obj, Mapping) else None
    return hp if isinstance(hp, Mapping) else None


_NO_DECAY = [r"bias", r"layernorm", r"rmsnorm", r"(?:^|\.)norm(?:$|\.)", r"_norm(?:$|\.)"]
"""transformers' ``Trainer.get_decay_parameter_names``: these names (lower-cased) get no weight decay."""


def trainer_decay_names(model: nn.Module) -> set[str]:
    """The parameters the transformers Trainer puts in its weight-decay group: outside every ``nn.LayerNorm``
    and not named like a bias or a norm (``Trainer.get_decay_parameter_names``, re-done without importing it)."""
    import re

    pats = [re.compile(x) for x in _NO_DECAY]
    in_norm = {f"{m}.{n}" if m else n for m, mod in model.named_modules() if isinstance(mod, nn.LayerNorm)
               for n, _ in mod.named_parameters()}
    return {n for n, _ in model.named_parameters()
            if n not in in_norm and not any(x.search(n.lower()) for x in pats)}


def _optimizer_class(groups: list[Mapping[str, Any]]) -> tuple[type[torch.optim.Optimizer], str]:
    keys = set(groups[0]) if groups else set()
    if "decoupled_weight_decay" in keys:
        return (torch.optim.AdamW if groups[0].get("decoupled_weight_decay") else torch.optim.Adam), ""
    if {"momentum", "nesterov", "dampening"} <= keys:
        return torch.optim.SGD, ""
    if "betas" in keys:
        return torch.optim.AdamW, " (its class is not in the state: AdamW, the Trainer's default)"
    raise SpecError("the optimizer state does not say which optimizer made it")


def optimizer_from_state(model: nn.Module, state: Mapping[str, Any], where: str) -> tuple[Callable[[Any], torch.optim.Optimizer], str]:
    """``build_optimizer(model)`` whose parameter groups are the saved ones: the state's group sizes matched
    by one group of every parameter, or by the Trainer's decay / no-decay split (by parameter name), each
    saved state tensor the shape of its parameter. One line when neither fits."""
    groups = list(state.get("param_groups") or [])
    sizes = [len(g.get("params", [])) for g in groups]
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    decay = trainer_decay_names(model)
    candidates = {
        "one group of every parameter": [[n for n, _ in named]],
        "the transformers Trainer's weight-decay and no-decay groups (by parameter name)":
            [[n for n, _ in named if n in decay], [n for n, _ in named if n not in decay]],
    }
    shapes = {n: tuple(p.shape) for n, p in named}
    saved = state.get("state") or {}
    cls, cls_note = _optimizer_class(groups)
    for how, cand in candidates.items():
        if [len(c) for c in cand] != sizes:
            continue
        ids = [i for g in groups for i in g.get("params", [])]
        order = [n for c in cand for n in c]
        fits = all(not isinstance(t, torch.Tensor) or t.numel() <= 1 or tuple(t.shape) == shapes[order[k]]
                   for k, i in enumerate(ids) for t in (saved.get(i) or {}).values())
        if not fits:
            continue
        chosen = cand

        def build_optimizer(m: nn.Module, chosen: list[list[str]] = chosen) -> torch.optim.Optimizer:
            by_name = dict(m.named_parameters())
            return cls([{"params": [by_name[n] for n in c], **{k: v for k, v in g.items() if k == "weight_decay"}}  # type: ignore[call-arg]
                        for c, g in zip(chosen, groups, strict=True)])

        return build_optimizer, f"the optimizer is {cls.__name__}{cls_note} over {how}, as the checkpoint saved it ({sizes})"
    raise SpecError(f"{where}: the optimizer state has {len(sizes)} parameter group(s) of {sizes} parameters, which neither "
                    f"one group of every parameter ({len(named)}) nor the Trainer's decay / no-decay split "
                    f"({[len(c) for c in candidates[list(candidates)[1]]]}) fits; give the spec a build_optimizer(model) "
                    "that makes the run's groups")
