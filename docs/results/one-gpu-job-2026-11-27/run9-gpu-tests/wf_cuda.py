import json
import os

import torch
import torch.nn as nn

from lightning_gh.superoffload import HeterogeneousAdamW


def run(wf, dtype):
    torch.manual_seed(0)
    m = nn.Sequential(*[nn.Linear(512, 512) for _ in range(6)]).to("cuda", dtype)
    opt = HeterogeneousAdamW(m.parameters(), lr=1e-3, max_grad_norm=1e-3, module=m, speculative=False,
                             bucket_size=300_000, gpu_fraction=0.0, weights_first=wf)
    g = torch.Generator(device="cuda").manual_seed(1)
    for _ in range(12):
        x = torch.randn(64, 512, device="cuda", dtype=dtype, generator=g)
        m(x).float().square().mean().backward()
        opt.step(); opt.zero_grad()
    opt.synchronize()
    st = opt.state_dict()["state"]
    out = ([p.detach().clone() for p in m.parameters()], {k: {kk: (vv.clone() if torch.is_tensor(vv) else vv) for kk, vv in v.items()} for k, v in st.items()}, dict(opt.stats))
    opt.close()
    return out
res = {}
for dtype in (torch.float32, torch.bfloat16):
    a, b = run(True, dtype), run(False, dtype)
    same_p = all(torch.equal(x, y) for x, y in zip(a[0], b[0]))
    same_s = all(torch.equal(a[1][k][kk].cpu(), b[1][k][kk].cpu()) for k in a[1] for kk in a[1][k] if torch.is_tensor(a[1][k][kk]))
    res[str(dtype)] = {"params_bitwise": same_p, "state_bitwise": same_s, "writeback_ms_wf": a[2].get("writeback_ms"),
                       "writeback_ms_onepass": b[2].get("writeback_ms"), "clipped": a[2]["clipped_steps"]}
print(json.dumps(res, indent=1))
json.dump(res, open(os.environ["OUT"] + "/wf_cuda.json", "w"), indent=1)
