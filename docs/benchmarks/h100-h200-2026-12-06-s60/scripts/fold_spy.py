"""Fold py-spy raw stacks: keep samples inside the timed decodes (frames with emit_rounds), report
the share of samples by leaf-ish category and by chosen frames."""
import collections, re, sys
path = sys.argv[1]
total = 0; dec = 0
leaf = collections.Counter(); incl = collections.Counter(); py = collections.Counter()
for line in open(path):
    line = line.rstrip()
    if not line:
        continue
    stack, _, n = line.rpartition(" ")
    n = int(n); total += n
    frames = stack.split(";")
    if not any("emit_rounds" in f for f in frames):
        continue
    dec += n
    leaf[re.sub(r"\s*\(.*", "", frames[-1])[:90]] += n
    seen = set()
    for f in frames:
        name = re.sub(r"\s*\(.*", "", f)[:90]
        if name not in seen:
            seen.add(name); incl[name] += n
    # deepest python frame
    pyf = [f for f in frames if ".py:" in f]
    if pyf:
        py[re.sub(r"^(.*?) \((.*?):\d+\)$", r"\1 (\2)", pyf[-1])[:110]] += n
print(f"samples {total}, in decode {dec}")
for title, c in (("leaf", leaf), ("inclusive", incl), ("deepest python", py)):
    print(f"== {title}")
    for k, v in c.most_common(60):
        print(f"{100*v/max(dec,1):6.1f}% {v:7d} {k}")
