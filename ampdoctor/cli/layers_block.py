"""``ampdoctor layers --dtype mxfp8,nvfp4``: the block-scaled formats' tables (``engine.layers_block``)."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console

from ampdoctor.cli.common import err
from ampdoctor.input.spec import SpecNames
from ampdoctor.scaled import BlockFormat, get_block_format


def split_block(dtype: str) -> tuple[str | None, list[BlockFormat]]:
    """``--dtype``'s element formats (as the rest of ``layers`` takes them; None when there are none) and its
    block-scaled ones."""
    names = [d.strip() for d in dtype.split(",") if d.strip()]
    blocks = [f for f in (get_block_format(d) for d in names) if f is not None]
    rest = [d for d in names if get_block_format(d) is None]
    return (",".join(rest) if rest else None), blocks


def block_tables(console: Console, spec: Path, names: SpecNames, fmts: list[BlockFormat], *, steps: int, device: str,
                 seed: int, what: tuple[str, ...], max_norm: float | None, top: int, csv: Path | None) -> None:
    """Run the FP32 reference steps with block-scaled statistics and print one table per format."""
    from ampdoctor.cli.progress import progress_display
    from ampdoctor.engine.forward import optimizer_argument
    from ampdoctor.engine.layers_block import block_layer_stats, worst
    from ampdoctor.engine.triage import prepare
    from ampdoctor.input.config import TriageConfig
    from ampdoctor.input.env import resolve_device
    from ampdoctor.input.spec import call_user, importable, load_spec
    from ampdoctor.io import write_atomic
    from ampdoctor.render.layers_block import print_block_table

    cfg = TriageConfig(steps=steps, device=device, seed=seed)
    dev = resolve_device(device)
    sp = load_spec(spec, names)
    with importable(spec), progress_display(err, steps) as progress:
        model, batches = prepare(sp, cfg, dev, progress)
        optimizer = (call_user(sp.build_optimizer, optimizer_argument(sp.build_optimizer, model),
                               what=f"{names.optimizer}()", path=sp.path) if sp.build_optimizer is not None else None)
        df = block_layer_stats(model, batches, fmts, steps=steps, what=what, loss_fn=sp.loss_fn, optimizer=optimizer,
                               device=dev, seed=seed, max_norm=max_norm)
    for f in fmts:
        print_block_table(console, f, worst(df, f.name), steps, top)
    if csv is not None:
        write_atomic(csv, df.to_csv(index=False))
