"""Per-sample ``Joint.__call__`` (a user transform's pair) and per-batch ``Batch(...)`` cost in two trees,
alternated, each run in a fresh process: ``python docs/scripts/batch_paths.py BEFORE_TREE AFTER_TREE``
(a tree: a checkout whose ``coordinated_prep`` imports; ``git worktree add`` one of the main before)."""
import subprocess
import sys
code = r'''
import sys, time, torch, numpy as np
from torchvision.transforms import v2
from coordinated_prep.pipeline.transforms import Joint
from coordinated_prep.trial.batching import Batch
from coordinated_prep.pipeline.structure import make_layout
j = Joint(transform=v2.RandomHorizontalFlip())
s = (torch.zeros(3, 8, 8, dtype=torch.uint8), 3)
for _ in range(2000): j(s)
t = time.perf_counter(); n = 50000
for _ in range(n): j(s)
per_sample = (time.perf_counter() - t) / n * 1e6
layout = make_layout([(np.zeros((3, 8, 8), np.uint8), 0)], (), "x")
leaves = [torch.zeros(64, 3, 8, 8, dtype=torch.uint8), torch.zeros(64, dtype=torch.int64)]
ids = torch.arange(64)
t = time.perf_counter(); m = 20000
for _ in range(m): Batch(layout, leaves, ids, ids)
per_batch = (time.perf_counter() - t) / m * 1e6
print(f"{per_sample:.2f} {per_batch:.2f}")
'''
for rnd in range(3):
    for side, path in (("before", sys.argv[1]), ("after", sys.argv[2])):
        out = subprocess.run([sys.executable, "-c", code], env={"PYTHONPATH": path, "PATH": "/usr/bin"}, capture_output=True, text=True, cwd="/tmp")
        print(side, rnd, "us/sample Joint, us/batch Batch():", out.stdout.strip() or out.stderr[-300:])
