"""Session 34, CPU: the primitives of one traced verify layer's two replays (16 rows), at Glimmer's
head geometry (hidden 1024 here), routed as on CUDA. Each launch is stood in for by zeros made to
depend on the launch's inputs (mx.depends), so the tape keeps what feeds it: a launch shows as
one Full + one Depends. Counts the graph of each replay's outputs by primitive."""
import collections, os, re, tempfile, time
exec(open(".sweep/s34/host_probe.py").read().split("from dflash.bench.runs import replay_mode")[0].replace("with stubbed_launches():", "if False:"))
from benchmarks import launch_cost
from dflash.metal import groups
from dflash.bench.runs import replay_mode, timed_run
from dflash import traced_layers
tokens = [int(t) for t in mx.random.randint(0, 2048, (24,)).tolist()]
replay = replay_mode(target, drafter, 16, 6)
seen = []
orig_call = traced_layers._Replay.__call__
def call(self, *inputs):
    out = orig_call(self, *inputs)
    if self.compiled is not None and inputs[0].ndim == 3 and inputs[0].shape[1] == 16 and len(seen) < 16:
        outs = out if isinstance(out, (tuple, list)) else [out]
        name = tempfile.mktemp(suffix=".dot"); mx.export_to_dot(name, *outs)
        text = open(name).read()
        labels = re.findall(r'label\s*=\s*"([A-Za-z_0-9]+)', text)
        seen.append((len(inputs), collections.Counter(labels)))
    return out
traced_layers._Replay.__call__ = call
with launch_cost.stubbed_launches():
    def launch_groups(spec, inputs, output_shapes, output_dtypes, count, dtype):
        outs = [mx.zeros(shape, dt) for shape, dt in zip(output_shapes, output_dtypes)]
        return mx.depends(outs, [i for i in inputs if isinstance(i, mx.array)])
    groups.launch_groups = launch_groups
    with kernel_patch.verify_kernels(target, drafter):
        timed_run(replay, prompt, len(tokens), set(), prompt.tolist() + tokens)
for n, c in seen[-4:]:
    print("replay with", n, "inputs:", sum(c.values()), "primitives:", dict(c.most_common()))
