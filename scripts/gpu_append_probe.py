"""Which part of a dense cache append on torch tensors waits for the stream:
counters of pyfa's own waits and a stream query after each step."""
import numpy as np
import torch

import pyfa

dev = pyfa.Device("cuda")
c = pyfa.KVCache(2, 128, 48, dtype=np.float16, sliding_window=40, device=dev)
k = torch.randn(20, 2, 128, dtype=torch.float16, device="cuda")
s = torch.cuda.Stream()
with torch.cuda.stream(s):
    c.append(k[:1], k[:1])
    for label, step in (("append same", lambda: c.append(k[1:3], k[1:3])),
                        ("append 2x", lambda: c.append(k[3:9], 2 * k[3:9])),
                        ("attend", lambda: c.attend(k[0, :1].expand(8, 128).contiguous()))):
        torch.cuda._sleep(1_000_000_000)
        before = pyfa.counters()
        step()
        busy = not s.query()
        after = pyfa.counters()
        print(label, "stream still busy:", busy, {n: after[n] - before[n] for n in after if after[n] != before[n]})
    s.synchronize()
