"""Summarise an ncu SASS source page (csv or csv.gz): stall totals, the hottest lines, samples by stretch."""
import csv, gzip, sys

path = sys.argv[1]
top = int(sys.argv[2]) if len(sys.argv) > 2 else 40
opener = gzip.open if path.endswith(".gz") else open
with opener(path, "rt") as f:
    rows = list(csv.reader(f))
head = next(r for r in rows if r and r[0] == "Address")
data = [r for r in rows[rows.index(head) + 1:] if len(r) == len(head) and r[0].startswith("0x")]
col = {h: i for i, h in enumerate(head)}
stall_cols = [h for h in head if h.startswith("stall_") and "Not Issued" not in h]
samples = [int(r[col["Warp Stall Sampling (All Samples)"]] or 0) for r in data]
total = sum(samples)
print("instructions", len(data), "samples", total)
sums = {h: sum(int(r[col[h]] or 0) for r in data) for h in stall_cols}
print("stalls:", ", ".join(f"{h[6:]} {100 * v / max(total, 1):.1f}%" for h, v in sorted(sums.items(), key=lambda x: -x[1]) if v))
order = sorted(range(len(data)), key=lambda i: -samples[i])[:top]
for i in sorted(order):
    r = data[i]
    reasons = sorted(((int(r[col[h]] or 0), h[6:]) for h in stall_cols), reverse=True)[:3]
    print(f"{i:5d} {samples[i]:6d} {100 * samples[i] / max(total, 1):5.1f}% ex={r[col['Instructions Executed']]:>8} {r[col['Source']].strip()[:60]:60s} "
          + " ".join(f"{n}:{v}" for v, n in reasons if v))
# Cumulative samples in stretches of 64 instructions.
step = 64
print("by stretch of", step)
for s in range(0, len(data), step):
    part = sum(samples[s:s + step])
    if part:
        print(f"  {s:5d}-{s + step - 1:5d} {100 * part / max(total, 1):5.1f}%  first: {data[s][col['Source']].strip()[:50]}")
