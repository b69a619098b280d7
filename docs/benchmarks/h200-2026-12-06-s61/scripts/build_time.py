import sys, os, json
import mlx.core as mx
from benchmarks import layer_stack as ls
from benchmarks.launch_cost import stubbed_launches
layers=int(os.environ.get('LAYERS','8')); ctx=int(os.environ.get('CTX','24')); rows=int(os.environ.get('ROWS','16'))
ls.GEOMETRIES['fullw']={'sliding_window':16, 'hidden_size':1024, 'intermediate_size':2048, 'num_attention_heads':8, 'num_key_value_heads':2, 'head_dim':128}
model=ls.build_layers('fullw','4bit',layers)
cache=ls.prefill(model, ctx)
inputs=[(mx.random.normal((1,rows,model.args.hidden_size))*0.5).astype(mx.bfloat16) for _ in range(4)]; mx.eval(inputs)
with stubbed_launches():
  with ls.arm_context(model, 'ours', attention=True):
    fw=ls.verify_forward_of(model, cache)
    for rep in range(int(os.environ.get('REPS','5'))):
        r=ls.time_forward(fw, inputs, layers, 40, 3)
        print(json.dumps({'tree': os.environ.get('TREE','?'), **r}), flush=True)
