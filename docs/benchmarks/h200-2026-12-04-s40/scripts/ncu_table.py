"""Print one line a profiled kernel from `ncu -i REP --page raw --csv` (stdin)."""
import csv
import sys

rows = list(csv.reader(sys.stdin))
head = rows[0]
want = ["Kernel Name", "launch__grid_size", "launch__block_size", "launch__registers_per_thread",
        "gpc__cycles_elapsed.max", "sm__cycles_active.avg", "smsp__inst_executed.sum",
        "smsp__average_warp_latency_per_inst_issued.ratio"]
idx = [head.index(w) if w in head else None for w in want]
for row in rows[2:]:
    out = []
    for w, i in zip(want, idx):
        v = row[i] if i is not None and i < len(row) else "-"
        out.append(v[-46:] if w == "Kernel Name" else v)
    print("  ".join(out))
