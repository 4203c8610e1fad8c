"""Evidence script (not part of the library): the ablations behind docs/architecture.md's table.

Runs one mode of bench/overhead.py's model (plain, floor, book) with parts of the engine
switched off by monkeypatching (norefresh, identity, keyonly, noaccount, nodel, nohook,
minref), counting instructions with callgrind between ``callgrind_control`` switches.
Run through ``ablate_instructions.sh PYTHONPATH MODE LABEL`` from the repository root."""
import sys, os, torch, contextlib, subprocess
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2]))
import overhead, chunk_offload
torch.set_num_threads(1)
mode = sys.argv[1]
x = torch.randn(4, 64)
model = overhead.build(200, 64, torch.device("cpu"))
mgr = None
if mode == "floor":
    overhead.install_floor(model)
elif mode.startswith("book"):
    mgr = chunk_offload.OffloadManager(chunk_offload.OffloadConfig(min_offload_bytes=1, offload=False, measure_time=False))
    for l in model: mgr.offload_module(l, "layer")
def one():
    with mgr.iteration() if mgr else contextlib.nullcontext():
        with mgr.chunk(microbatch=0) if mgr else contextlib.nullcontext():
            loss = model(x).sum()
        loss.backward()
for _ in range(3): one()
if "norefresh" in mode:
    mgr.policy.refresh = lambda: None
import chunk_offload.core.handler as hd, chunk_offload.core.saved as sv, chunk_offload.core.stats as st
H = hd.ChunkOffloadHandler
if "identity" in mode:
    H._pack = lambda self, t: t
    H._unpack = lambda self, t: t
if "keyonly" in mode:
    def _p(self, t):
        self._offload_key(t, self.current.inputs); return t
    H._pack = _p
    H._unpack = lambda self, t: t
if "noaccount" in mode:
    st.ResidentBytes.saved = lambda self, n: None
    st.ResidentBytes.freed = lambda self, n, h: None
if "nodel" in mode:
    sv.SavedRef.__del__ = lambda self: None
if "nohook" in mode:
    import chunk_offload.core.marks as mk
    mk.add_gradient_hook = lambda t, h: None
if "minref" in mode:
    class R:
        __slots__ = ("t", "v")
    def _p(self, t):
        r = R(); r.t = t; r.v = t._version; return r
    H._pack = _p
    H._unpack = lambda self, r: r.t
for _ in range(2): one()
import gc
gc.collect(); gc.disable()
pid = os.getpid()
subprocess.run(["callgrind_control", "-i", "on", str(pid)], capture_output=True)
for _ in range(int(sys.argv[2]) if len(sys.argv) > 2 else 2): one()
subprocess.run(["callgrind_control", "-i", "off", str(pid)], capture_output=True)
if mgr: mgr.close()
