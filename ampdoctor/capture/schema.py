"""The capture format: the manifest's JSON Schema (``ampdoctor/schema/capture.schema.json``), a small
validator that the schema drives, and the checks of the tensor files (``state.pt``, ``snapshot.pt``,
``batches.pt``) that JSON Schema cannot express. See docs/capture-format.md.

A capture is a file users mail to each other: the reader (``capture.read.read_capture``) validates
every field before using one, and the writer can validate what it is about to write::

    from ampdoctor.capture.schema import validate_manifest, validate_state
    validate_manifest(manifest, folder / "manifest.json")   # raises CaptureError naming the field
    validate_state(state, folder / "state.pt")

Each failure is one ``CaptureError`` line naming the file and the field. The validator understands the
part of JSON Schema (draft 2020-12) the schema uses: ``type``, ``enum``, ``const``, ``properties``,
``required``, ``additionalProperties``, ``items``, ``minimum``, ``maximum``, ``anyOf`` and local ``$ref``;
``jsonschema`` (a dev dependency) checks in the tests that both agree.
"""

from __future__ import annotations

import json
import math
from functools import cache
from pathlib import Path
from typing import Any

from ampdoctor.errors import CaptureError
from ampdoctor.watch.ring import RING_LAYER_COLUMNS, RING_LAYERS_FILE, RING_STEP_COLUMNS, RING_STEPS_FILE

SCHEMA_FILE = Path(__file__).resolve().parent.parent / "schema" / "capture.schema.json"
CAPTURE_VERSION = 1
"""The capture format this ampdoctor reads and writes (``schema_version``)."""
MAX_MANIFEST_BYTES = 64 << 20
"""A manifest larger than this is refused before it is parsed (a real one is kilobytes)."""
AGAIN = "the capture is damaged or was edited; capture the run again (or fix that field)"

MICRO_KEY = "ampdoctor_micro_batches"
"""A captured step that accumulated gradients: ``{MICRO_KEY: [micro-batch, ...]}``."""
MANIFEST = "manifest.json"
"""The capture's manifest, in every capture folder."""
MODEL_INPUTS_KEY = "ampdoctor_model_inputs"
"""A batch taken from the model's own call (``Monitor`` without ``batch=``): ``{MODEL_INPUTS_KEY:
{"args": [...], "kwargs": {...}}}`` (read back as ``input.batches.ModelInputs``)."""
STATE_FILE = "state.pt"
"""The state before a skipped failing step (model, optimizer, scaler): its replay runs that step alone."""
SNAPSHOT_FILE = "snapshot.pt"
"""The last periodic snapshot: a replay from it runs every batch since."""
BATCHES_FILE = "batches.pt"
RNG_FILE = "rng.pt"
STATS_FILE = "stats.json"

_TYPE_WORD = {"integer": "an integer", "number": "a number", "string": "a text", "boolean": "true or false",
              "null": "null", "object": "an object", "array": "a list"}


@cache
def schema() -> dict[str, Any]:
    """The manifest's JSON Schema."""
    return json.loads(SCHEMA_FILE.read_text(encoding="utf-8"))  # type: ignore[no-any-return]


def _is_type(v: Any, t: str) -> bool:
    """JSON Schema's types over what ``json.loads`` gives (a bool is no number; 3.0 is an integer)."""
    if t == "null":
        return v is None
    if t == "boolean":
        return isinstance(v, bool)
    if t == "string":
        return isinstance(v, str)
    if t == "object":
        return isinstance(v, dict)
    if t == "array":
        return isinstance(v, list)
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    if t == "number":
        return True
    return isinstance(v, int) or (math.isfinite(v) and float(v).is_integer())  # integer


def _same(a: Any, b: Any) -> bool:
    """JSON equality: 1 == 1.0, but true is not 1."""
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a == b
    if _is_type(a, "number") and _is_type(b, "number"):
        return bool(a == b)
    return type(a) is type(b) and bool(a == b)


def _show(v: Any) -> str:
    """The value, briefly, with what it is."""
    if isinstance(v, str):
        return f"the text {v[:40]!r}" + ("..." if len(v) > 40 else "")
    if isinstance(v, bool) or v is None:
        return json.dumps(v)
    if isinstance(v, (int, float)):
        s = repr(v)
        return s if len(s) <= 30 else s[:27] + "..."
    if isinstance(v, list):
        return f"a list of {len(v)}"
    if isinstance(v, dict):
        return "an object"
    return type(v).__name__


def _expects(s: dict[str, Any], root: dict[str, Any]) -> str:
    """What a schema node accepts, in words."""
    if "$ref" in s:
        return _expects(_resolve(s["$ref"], root), root)
    if "const" in s:
        return json.dumps(s["const"])
    if "enum" in s:
        return "one of " + ", ".join(json.dumps(x) for x in s["enum"])
    if "anyOf" in s:
        return " or ".join(_expects(x, root) for x in s["anyOf"])
    t = s.get("type")
    if t is None:
        return "anything"
    words = [_TYPE_WORD[x] for x in (t if isinstance(t, list) else [t])]
    text = " or ".join(words)
    lo, hi = s.get("minimum"), s.get("maximum")
    if lo is not None and hi is not None:
        text += f" from {lo} to {hi}"
    elif lo is not None:
        text += f" of at least {lo}"
    elif hi is not None:
        text += f" of at most {hi}"
    return text


def _resolve(ref: str, root: dict[str, Any]) -> dict[str, Any]:
    if not ref.startswith("#/"):
        raise ValueError(f"only local $ref are supported, not {ref!r}")
    node: Any = root
    for part in ref[2:].split("/"):
        node = node[part]
    return node  # type: ignore[no-any-return]


def _field(path: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else key


def errors(value: Any, s: dict[str, Any] | None = None, path: str = "", root: dict[str, Any] | None = None) -> list[tuple[str, str]]:
    """(field, what is wrong) for the first failure under each schema keyword; [] when ``value`` fits.
    Depth first, in the schema's order, so the first item is the first field a reader would trip on."""
    root = root or schema()
    s = root if s is None else s
    if "$ref" in s:
        return errors(value, _resolve(s["$ref"], root), path, root)
    where = path or "the manifest"
    if "anyOf" in s:
        if any(not errors(value, x, path, root) for x in s["anyOf"]):
            return []
        return [(where, f"is {_show(value)}; expected {_expects(s, root)}")]
    if "const" in s and not _same(value, s["const"]):
        return [(where, f"is {_show(value)}; expected {_expects(s, root)}")]
    if "enum" in s and not any(_same(value, x) for x in s["enum"]):
        return [(where, f"is {_show(value)}; expected {_expects(s, root)}")]
    t = s.get("type")
    if t is not None and not any(_is_type(value, x) for x in (t if isinstance(t, list) else [t])):
        return [(where, f"is {_show(value)}; expected {_expects(s, root)}")]
    if _is_type(value, "number"):
        lo, hi = s.get("minimum"), s.get("maximum")
        if (lo is not None and value < lo) or (hi is not None and value > hi):
            return [(where, f"is {_show(value)}; expected {_expects(s, root)}")]
    out: list[tuple[str, str]] = []
    if isinstance(value, dict):
        for k in s.get("required", []):
            if k not in value:
                out.append((_field(path, k), f"is missing; a capture manifest needs {', '.join(s['required'])}"))
        props = s.get("properties", {})
        for k, sub in props.items():
            if k in value:
                out += errors(value[k], sub, _field(path, k), root)
        extra = s.get("additionalProperties", True)
        if isinstance(extra, dict):
            for k, v in value.items():
                if k not in props:
                    out += errors(v, extra, _field(path, str(k)), root)
        elif extra is False:
            out += [(_field(path, str(k)), "is not a field of this format") for k in value if k not in props]
    if isinstance(value, list) and "items" in s:
        for i, v in enumerate(value):
            out += errors(v, s["items"], _field(path, i), root)
            if out:
                break
    return out


def validate_manifest(manifest: Any, path: str | Path) -> None:
    """Raise ``CaptureError`` (one line naming ``path`` and the field) unless ``manifest`` fits the schema
    and is consistent with itself: the version first (its own message), then every field, then
    ``batch_steps`` ending at ``step`` and the step numbers in order."""
    p = Path(path)
    if not isinstance(manifest, dict):
        raise CaptureError(f"{p}: the manifest is {_show(manifest)}, not an object of fields; {AGAIN}")
    if "schema_version" in manifest and manifest["schema_version"] != CAPTURE_VERSION:
        v = manifest["schema_version"]
        newer = _is_type(v, "integer") and v > CAPTURE_VERSION
        raise CaptureError(f"{p}: field schema_version is {_show(v)}; this ampdoctor reads capture version {CAPTURE_VERSION}"
                           + ("; upgrade ampdoctor to read this capture" if newer else
                              "; see docs/capture-format.md (migration) or capture again"))
    found = errors(manifest)
    if found:
        field, what = found[0]
        more = f" (and {len(found) - 1} more field(s))" if len(found) > 1 else ""
        raise CaptureError(f"{p}: field {field} {what}{more}; {AGAIN}")
    steps = manifest["batch_steps"]
    step = manifest["step"]
    if steps and steps[-1] != step:
        raise CaptureError(f"{p}: field batch_steps ends at step {steps[-1]}, not at the failing step {step}; {AGAIN}")
    if any(b <= a for a, b in zip(steps, steps[1:], strict=False)):
        raise CaptureError(f"{p}: field batch_steps is not in increasing step order; {AGAIN}")
    for k in ("state_step", "snapshot_step"):
        v = manifest.get(k)
        if v is not None and v > step:
            raise CaptureError(f"{p}: field {k} is {v}, after the failing step {step}; {AGAIN}")


def read_manifest(path: str | Path) -> dict[str, Any]:
    """Read and validate a manifest file; every problem is one ``CaptureError`` line."""
    p = Path(path)
    try:
        if p.is_dir():
            raise CaptureError(f"{p} is a folder, not the capture's manifest file; {AGAIN}")
        size = p.stat().st_size
        if size > MAX_MANIFEST_BYTES:
            raise CaptureError(f"{p} is {size} bytes; a capture manifest is a few kilobytes: {AGAIN}")
        manifest = json.loads(p.read_bytes().decode("utf-8"))
    except CaptureError:
        raise
    except UnicodeDecodeError as e:
        raise CaptureError(f"{p}: not UTF-8 text ({e.reason} at byte {e.start}); the capture is damaged") from None
    except (ValueError, RecursionError) as e:  # JSONDecodeError is a ValueError
        raise CaptureError(f"{p}: not valid JSON ({str(e)[:120] or type(e).__name__}); the capture is truncated or damaged") from None
    except OSError as e:
        raise CaptureError(f"{p}: cannot be read ({e.strerror or e})") from None
    validate_manifest(manifest, p)
    return manifest  # type: ignore[no-any-return]


# the tensor files ---------------------------------------------------------------------------------

SCALER_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")


def _number(v: Any) -> float | None:
    """A Python number or a one-element tensor, as a float (None for anything else)."""
    if isinstance(v, bool):
        return None
    if isinstance(v, (int, float)):
        return float(v)
    numel = getattr(v, "numel", None)
    if callable(numel) and numel() == 1 and hasattr(v, "item"):
        x = v.item()
        return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None
    return None


def validate_scaler_state(st: Any, path: str | Path, field: str = "scaler") -> None:
    """A GradScaler ``state_dict()``: ``scale`` > 0, ``growth_factor`` > 1, ``backoff_factor`` in (0, 1),
    ``growth_interval`` >= 1 and ``_growth_tracker`` >= 0 (whole numbers), all finite."""
    p = Path(path)
    if not isinstance(st, dict):
        raise CaptureError(f"{p}: entry {field} is {_show(st)}, not a GradScaler state_dict(); {AGAIN}")
    missing = [k for k in SCALER_KEYS if k not in st]
    if missing:
        raise CaptureError(f"{p}: entry {field} has no {missing[0]!r}; a GradScaler state_dict() holds "
                           f"{', '.join(SCALER_KEYS)}; {AGAIN}")
    rules = {"scale": (lambda x: x > 0, "a positive number"), "growth_factor": (lambda x: x > 1, "a number above 1"),
             "backoff_factor": (lambda x: 0 < x < 1, "a number between 0 and 1"),
             "growth_interval": (lambda x: x >= 1 and x.is_integer(), "a whole number of at least 1"),
             "_growth_tracker": (lambda x: x >= 0 and x.is_integer(), "a whole number of at least 0")}
    for k, (ok, want) in rules.items():
        x = _number(st[k])
        if x is None or not math.isfinite(x) or not ok(x):
            raise CaptureError(f"{p}: entry {field}.{k} is {_show(st[k]) if x is None else repr(x)}; expected {want}; {AGAIN}")


def validate_optimizer_state(st: Any, path: str | Path, field: str = "optimizer") -> None:
    """An optimizer ``state_dict()``: ``state`` (a dict) and ``param_groups`` (a list of dicts with ``params``)."""
    p = Path(path)
    if not isinstance(st, dict) or not isinstance(st.get("state"), dict) or not isinstance(st.get("param_groups"), list):
        raise CaptureError(f"{p}: entry {field} is not an optimizer state_dict() (a dict with 'state' and "
                           f"'param_groups'); {AGAIN}")
    for i, g in enumerate(st["param_groups"]):
        if not isinstance(g, dict) or not isinstance(g.get("params"), list):
            raise CaptureError(f"{p}: entry {field}.param_groups[{i}] has no list of params; {AGAIN}")


def validate_state(st: Any, path: str | Path) -> None:
    """``state.pt`` / ``snapshot.pt``: ``{"model": {name: tensor}, "optimizer": state_dict | None,
    "scaler": GradScaler state_dict | None}``."""
    import torch

    p = Path(path)
    if not isinstance(st, dict):
        raise CaptureError(f"{p} holds {_show(st)}, not the dict of model, optimizer and scaler state; {AGAIN}")
    model = st.get("model")
    if not isinstance(model, dict) or not model:
        raise CaptureError(f"{p}: entry model is {'missing' if model is None else _show(model)}; it must map "
                           f"parameter names to tensors (model.state_dict()); {AGAIN}")
    for k, v in model.items():
        if not isinstance(k, str):
            raise CaptureError(f"{p}: entry model has the key {k!r}, not a parameter name; {AGAIN}")
        if not isinstance(v, torch.Tensor):
            raise CaptureError(f"{p}: entry model[{k!r}] is {_show(v)}, not a tensor; {AGAIN}")
    if st.get("optimizer") is not None:
        validate_optimizer_state(st["optimizer"], p)
    if st.get("scaler") is not None:
        validate_scaler_state(st["scaler"], p)


def validate_batches(batches: Any, path: str | Path) -> None:
    """``batches.pt``: a non-empty list, one batch per step (a ``{MICRO_KEY: [micro-batch, ...]}`` dict for an
    accumulated step)."""
    p = Path(path)
    if not isinstance(batches, list) or not batches:
        raise CaptureError(f"{p} holds {_show(batches) if batches is not None else 'nothing'}, not a list of batches "
                           "(pass batch= to monitor.step so the capture can keep it)")


# the lookback ring's tables -----------------------------------------------------------------------

MAX_RING_BYTES = 256 << 20


def read_ring(folder: str | Path, files: list[str]) -> tuple[Any, Any] | None:
    """The ring's two tables as pandas DataFrames (steps, layers), checked: the columns, numbers where numbers
    belong, steps in order. None when the capture holds no ring (an older writer); a damaged table is one
    ``CaptureError`` line naming the file and the column."""
    if RING_STEPS_FILE not in files:
        return None
    import pandas as pd

    p = Path(folder)
    out = []
    for name, cols in ((RING_STEPS_FILE, RING_STEP_COLUMNS), (RING_LAYERS_FILE, RING_LAYER_COLUMNS)):
        f = p / name
        try:
            if f.stat().st_size > MAX_RING_BYTES:
                raise CaptureError(f"{f} is {f.stat().st_size} bytes, more than a ring of any size holds; {AGAIN}")
            df = pd.read_csv(f, dtype={"layer": str} if "layer" in cols else None, keep_default_na=False,
                             na_values=[""])
        except CaptureError:
            raise
        except FileNotFoundError:
            raise CaptureError(f"{p}: {name} is named in the manifest's files but missing; {AGAIN}") from None
        except Exception as e:
            raise CaptureError(f"{f}: not a CSV table ({type(e).__name__}: {str(e)[:120]}); {AGAIN}") from None
        missing = [c for c in cols if c not in df.columns]
        if missing:
            raise CaptureError(f"{f}: no column {missing[0]!r}; {AGAIN}")
        for c in cols:
            if c == "layer":
                continue
            num = pd.to_numeric(df[c], errors="coerce")
            if (num.isna() & df[c].notna()).any():
                row = int((num.isna() & df[c].notna()).to_numpy().nonzero()[0][0])
                raise CaptureError(f"{f}: column {c!r} holds {str(df[c].iloc[row])[:40]!r} in row {row + 1}, not a number; {AGAIN}")
            df[c] = num
        if df["step"].isna().any() or not df["step"].is_monotonic_increasing:
            raise CaptureError(f"{f}: column 'step' is not the steps in order; {AGAIN}")
        out.append(df)
    return out[0], out[1]
