"""Host memory an armed capture holds, on a 224x224 image model (issue 27): peak RSS armed against unarmed.

    python bench/bench_capture_memory.py [--steps 250] [--batch 16] [--hold-mib 0,64] [--snapshot-every 100]

Each variant runs in a fresh subprocess: a small CNN on batches of ``batch x 3 x 224 x 224`` float32
(9.6 MB at 16), AdamW, autocast fp16 + GradScaler, a Monitor in sentinel mode. Variants: ``unarmed``
(no capture), and ``armed`` with each ``--hold-mib`` (0: the default budget, a thirty-second of the
machine's RAM, capped by ``capture_max_bytes``). Printed per variant: peak RSS (ru_maxrss), its
growth over unarmed, the most the capture reported holding (the step log's ``capture_held_bytes``)
and how many snapshots it took early to stay in budget. Before the bound, an armed capture held
every batch since its last snapshot (``snapshot_every`` x the batch size).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

CHILD = r"""
import json, resource, sys, tempfile, torch
from torch import nn
from ampdoctor import Monitor
steps, batch, hold, armed, every = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1", int(sys.argv[5])
torch.manual_seed(0)
torch.set_num_threads(1)
model = nn.Sequential(nn.Conv2d(3, 8, 7, stride=4), nn.ReLU(), nn.Conv2d(8, 16, 3, stride=2), nn.ReLU(),
                      nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10))
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
sc = torch.amp.GradScaler("cpu")
tmp = tempfile.mkdtemp()
kw = dict(capture=tmp + "/cap", snapshot_every=every, capture_hold_bytes=hold or None) if armed else {}
mon = Monitor(model, opt, sc, mode="sentinel", quiet=True, **kw)
g = torch.Generator().manual_seed(0)
most = 0
for step in range(steps):
    x = torch.randn(batch, 3, 224, 224, generator=g)
    y = torch.randint(0, 10, (batch,), generator=g)
    with mon.autocast():
        loss = nn.functional.cross_entropy(model(x).float(), y)
    rec = mon.step(loss, batch=(x, y))
    most = max(most, rec.capture_held or 0)
mon.close()
early = mon.capture.early_snapshots if mon.capture is not None else 0
budget = mon.capture.hold_bytes if mon.capture is not None else 0
print(json.dumps({"rss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, "held": most, "early": early,
                  "budget": budget}))
"""


def run(steps: int, batch: int, hold: int, armed: bool, every: int) -> dict[str, int]:
    out = subprocess.run([sys.executable, "-c", CHILD, str(steps), str(batch), str(hold), "1" if armed else "0", str(every)],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=250)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--hold-mib", default="0,64", help="comma-separated capture_hold_bytes in MiB (0: the default)")
    ap.add_argument("--snapshot-every", type=int, default=100)
    a = ap.parse_args()
    mb = a.batch * 3 * 224 * 224 * 4 / 2**20
    print(f"{a.steps} steps, batches of {a.batch}x3x224x224 float32 ({mb:.1f} MiB), snapshot_every={a.snapshot_every}")
    base = run(a.steps, a.batch, 0, False, a.snapshot_every)
    print(f"  {'variant':28} {'peak RSS MiB':>12} {'over unarmed':>12} {'held max MiB':>12} {'budget MiB':>10} {'early':>5}")
    print(f"  {'unarmed':28} {base['rss_kib'] / 1024:12.0f} {0:12.0f} {'-':>12} {'-':>10} {'-':>5}")
    for h in (int(x) for x in a.hold_mib.split(",")):
        r = run(a.steps, a.batch, h * 2**20, True, a.snapshot_every)
        name = f"armed, hold {'default' if h == 0 else f'{h} MiB'}"
        print(f"  {name:28} {r['rss_kib'] / 1024:12.0f} {(r['rss_kib'] - base['rss_kib']) / 1024:12.0f} "
              f"{r['held'] / 2**20:12.1f} {r['budget'] / 2**20:10.0f} {r['early']:5d}")


if __name__ == "__main__":
    main()
