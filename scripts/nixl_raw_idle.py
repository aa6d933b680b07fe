"""The CPU an idle raw NIXL agent costs with its progress thread, the setting Dynamo's Rust frontend
uses (`DYN_MM_NIXL_PROGRESS_DELAY_US`, default 1000): the anchor beside `nixl-connect bench
--idle-cpu` (whose `waiting_readable_cpu_pct` is a connector with one readable waiting).

    .venv/bin/python scripts/nixl_raw_idle.py DELAY_US     -> one line: % of a core over 2 s

NIXL's Python API always sets the progress thread's delay to 0 (a spinning thread, the default
of Dynamo's Python module); the agent config's `pthrDelay` is set through a subclass here.
"""
import os, sys, time
import nixl._api as api
import numpy as np
DELAY = int(sys.argv[1])
real = api.nixlBind.nixlAgentConfig
class Cfg(real):
    @property
    def pthrDelay(self):
        return real.pthrDelay.__get__(self)
    @pthrDelay.setter
    def pthrDelay(self, v):
        real.pthrDelay.__set__(self, DELAY)
api.nixlBind.nixlAgentConfig = Cfg
cfg = api.nixl_agent_config(enable_prog_thread=True, backends=["UCX"])
agent = api.nixl_agent("idle-%d" % os.getpid(), cfg)
buf = np.ones(1 << 20, dtype=np.uint8)
reg = agent.register_memory([(buf.ctypes.data, buf.nbytes, 0, "")], "DRAM")
md = agent.get_agent_metadata()
time.sleep(0.5)
t0 = time.process_time(); w0 = time.time()
time.sleep(2)
print(f"raw NIXL agent, progress thread delay {DELAY} us, 1 MiB registered, idle: {(time.process_time()-t0)/(time.time()-w0)*100:.2f}% of a core")
