import sys, re, collections, contextlib
import mlx.core as mx
sys.argv=[sys.argv[0]]+sys.argv[1:]
from benchmarks import layer_stack as ls
from benchmarks.launch_cost import stubbed_launches
from dflash.cache.checkpoint import SpeculativeCheckpoint
import os
layers=int(os.environ.get('LAYERS','4')); ctx=int(os.environ.get('CTX','512')); rows=int(os.environ.get('ROWS','16'))
arm=os.environ.get('ARM','ours')
geo=os.environ.get('GEO','tiny')
if geo=='full':
    ls.GEOMETRIES['fullw']={'sliding_window':int(os.environ.get('WIN','64'))}
    if os.environ.get('SMALL'):
        ls.GEOMETRIES['fullw'].update(hidden_size=1024, intermediate_size=2048, num_attention_heads=8, num_key_value_heads=2, head_dim=128)
    geo='fullw'
model=ls.build_layers(geo,'4bit',layers)
cache=ls.prefill(model, ctx)
h=(mx.random.normal((1,rows,model.args.hidden_size))*0.5).astype(mx.bfloat16); mx.eval(h)
with stubbed_launches():
  with ls.arm_context(model, arm, attention=True):
    for it in range(4):
      cp=SpeculativeCheckpoint.begin(cache, rows)
      out=ls.run_layers(model,h,cache)
      extra=[]
      for p in cache:
        if getattr(p,'kv',None) is not None: extra.append(p.kv)
        g=getattr(p,'guard',None)
        if getattr(g,'pending',None) is not None: extra.append(g.pending)
      if it==3:
        mx.export_to_dot('/tmp/fw.dot', out, *extra)
      mx.eval(out, *extra)
      cp.rollback()
labels=collections.Counter(re.findall(r'label ="([^"]+)"', open('/tmp/fw.dot').read()))
tot=sum(labels.values())
print('nodes', tot, 'per layer', tot/layers)
for k,v in labels.most_common(): print(f'{v/layers:6.2f} {k}')
