"""Session 42 probe: does mlx's cuda_kernel launch honour __cluster_dims__ (a header
redefining __global__), and does distributed shared memory work through it?"""
import mlx.core as mx

HEADER = """
#undef __global__
#define __global__ __attribute__((global)) __launch_bounds__(64, 2) __cluster_dims__(CLUSTER, 1, 1)
"""
BODY = """
  __shared__ float buf[64];
  const unsigned t = threadIdx.x;
  unsigned rank, n, cid;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
  asm volatile("mov.u32 %0, %%cluster_nctarank;" : "=r"(n));
  asm volatile("mov.u32 %0, %%clusterid.x;" : "=r"(cid));
  buf[t] = float(blockIdx.x * 1000 + t);
  asm volatile("barrier.cluster.arrive.release.aligned;\\nbarrier.cluster.wait.acquire.aligned;" ::: "memory");
  const unsigned peer = n > 1 ? (rank + 1) % n : rank;
  const unsigned local = static_cast<unsigned>(__cvta_generic_to_shared(&buf[t]));
  unsigned remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"(peer));
  float v;
  asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(remote) : "memory");
  asm volatile("barrier.cluster.arrive.release.aligned;\\nbarrier.cluster.wait.acquire.aligned;" ::: "memory");
  out[blockIdx.x * 64 + t] = v;
  if (t == 0) { info[blockIdx.x * 4] = rank; info[blockIdx.x * 4 + 1] = n; info[blockIdx.x * 4 + 2] = cid; }
"""
for cluster in (2, 4, 8):
    k = mx.fast.cuda_kernel(
        name=f"probe_cluster{cluster}",
        input_names=["a"],
        output_names=["out", "info"],
        source=BODY,
        header=HEADER.replace("CLUSTER", str(cluster)),
    )
    groups = 16
    out, info = k(
        inputs=[mx.zeros((1,))],
        output_shapes=[(groups * 64,), (groups * 4,)],
        output_dtypes=[mx.float32, mx.uint32],
        grid=(groups * 64, 1, 1),
        threadgroup=(64, 1, 1),
    )
    mx.eval(out, info)
    o = out.tolist()
    inf = info.tolist()
    ok = True
    for b in range(groups):
        rank, n = inf[4 * b], inf[4 * b + 1]
        peer_block = b - rank + (rank + 1) % n
        for t in range(64):
            if o[b * 64 + t] != peer_block * 1000 + t:
                ok = False
    print(f"cluster {cluster}: ranks {inf[0::4][:8]} n {inf[1::4][:4]} ids {inf[2::4][:8]} dsmem ok {ok}")
